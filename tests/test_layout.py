"""The layout tells the architecture: a package per concern, imports that only go down.

Every module's imports are read from its source (all of them: at the top, inside functions, under
`if TYPE_CHECKING:`; a module that names another's types knows it), and three rules are checked:
no import circle between modules; a module imports only from its own layer or the layers below it
(`LAYERS`); and no module takes another package's private (underscore) names.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import megatrain

ROOT = Path(megatrain.__file__).parent

# Bottom to top. A module belongs to the longest entry its dotted name starts with; the package's
# own top-level modules (the CLI and its commands, config, trainer, runtime, evaluation) are the
# top layer, but for those that import nothing above themselves and that every layer may use.
LAYERS = [
    # errors, metrics and trackers; determinism: how sums on a GPU are ordered
    # hub: names on the Hugging Face Hub -> files in its cache; devices: the run's device, checked
    (
        "megatrain.errors",
        "megatrain.metrics",
        "megatrain.trackers",
        "megatrain.determinism",
        "megatrain.hub",
        "megatrain.devices",
    ),
    ("megatrain.models",),  # decoder families, their config.json, compiled hot functions
    ("megatrain.data",),  # tokenizers, dataset files -> micro-batches
    ("megatrain.host",),  # the model's fp32 state and buffers in host memory
    ("megatrain.parallel",),  # ranks, machines, collectives
    ("megatrain.planning",),  # where every byte goes, before anything is allocated
    ("megatrain.io",),  # weights, checkpoints, output directories
    ("megatrain.objectives",),  # what a step's loss is
    ("megatrain.engine",),  # the step: sweeps, transport, optimizer
    ("megatrain.rl",),  # rollouts: sampling, the policy on the device, rewards
    ("megatrain",),
]


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def package_of(module: str) -> str:
    """The package a module is part of (a package's __init__ is part of the package)."""
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


@cache
def imports() -> list[tuple[str, str, int, str | None]]:
    """(importer, imported module, line, name taken or None) for every import of the package's own
    modules, and every attribute read of a module so imported; a name that is a submodule counts
    as that module."""
    found = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> the package module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(module, a.name, node.lineno, None) for a in node.names if a.name in modules()]
            elif isinstance(node, ast.ImportFrom):
                base = absolute(module, node)
                if base not in modules():
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in modules():
                        found.append((module, sub, node.lineno, None))
                        bound[a.asname or a.name] = sub
                    else:
                        found.append((module, base, node.lineno, a.name))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
            ):
                found.append((module, bound[node.value.id], node.lineno, node.attr))
    return found


def absolute(module: str, node: ast.ImportFrom) -> str:
    """The dotted name an `from ... import` in `module` reads from."""
    if not node.level:
        return node.module or ""
    parts = package_of(module).split(".")
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def layer(module: str) -> int:
    def matches(entry: str) -> bool:
        return module == entry or module.startswith(entry + ".")

    entry = max((e for names in LAYERS for e in names if matches(e)), key=len)
    return next(i for i, names in enumerate(LAYERS) if entry in names)


def where(module: str, line: int) -> str:
    return f"{modules()[module].relative_to(ROOT.parent)}:{line}"


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: one cycle through each strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(cycle_in(set(component), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    path = [min(component)]
    while True:
        nxt = min(w for w in edges[path[-1]] if w in component)
        if nxt in path:
            return path[path.index(nxt) :] + [nxt]
        path.append(nxt)


def test_no_import_circles():
    edges: dict[str, set[str]] = {m: set() for m in modules()}
    for importer, imported, _, _ in imports():
        if imported != importer:
            edges[importer].add(imported)
    assert circles(edges) == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in circles(edges))


def test_imports_go_down_the_layers():
    """A module imports from its own layer or from one below it."""
    up = sorted(
        {
            f"{where(importer, line)}: {importer} imports {imported} (layer {layer(imported)} above {layer(importer)})"
            for importer, imported, line, _ in imports()
            if layer(imported) > layer(importer)
        }
    )
    assert up == [], "imports that climb:\n" + "\n".join(up)


def test_no_module_takes_another_packages_private_names():
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    taken = [
        f"{where(importer, line)}: {importer} takes {imported}{'.' + name if name else ''}"
        for importer, imported, line, name in imports()
        if package_of(imported) != package_of(importer)
        and any(private(part) for part in [*imported.split("."), name or ""])
    ]
    assert taken == [], "private names taken across packages:\n" + "\n".join(taken)


def test_every_package_has_its_place_and_says_what_it_owns():
    packages = [m for m, p in modules().items() if p.name == "__init__.py"]
    placed = {e for names in LAYERS for e in names}
    assert sorted(p for p in packages if p not in placed) == []
    silent = [p for p in packages if not ast.get_docstring(ast.parse(modules()[p].read_text()))]
    assert silent == []


def test_the_checks_can_fail():
    """A circle in a made-up graph is found, and modules fall in the layers declared for them."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert (
        layer("megatrain.engine.engine") > layer("megatrain.planning.placement") > layer("megatrain.models")
    )
    assert layer("megatrain.metrics") == 0 and layer("megatrain.trainer") == len(LAYERS) - 1


def _missing_names(source: str) -> list[str]:
    """The `from megatrain... import name` lines of `source` naming what the package lacks."""
    import importlib.util

    missing = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("megatrain")
        ):
            module = importlib.import_module(node.module)
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(name)
                if not hasattr(module, alias.name) and not submodule:
                    missing.append(f"line {node.lineno}: {node.module}.{alias.name}")
    return missing


def test_every_name_the_tests_import_exists():
    """The GPU tests run only on a GPU: a name they import that the package renamed or removed is
    caught here, on the CPU, not on the next device run."""
    tests = Path(__file__).parent
    missing = {f.name: m for f in sorted(tests.glob("*.py")) if (m := _missing_names(f.read_text()))}
    assert not missing, missing
    assert _missing_names("def f():\n    from megatrain.planning.probe import probe_layer_memory\n")
