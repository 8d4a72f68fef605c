"""The configuration keys as documentation: `docs/configuration.md` and `megatrain train --help`
both come from TrainConfig's field docstrings, so the two cannot say different things.

    python scripts/gen_config_docs.py    # rewrite docs/configuration.md after changing a docstring
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

from .config import NOT_TAKEN, TrainConfig, key_docs

PAGE = "docs/configuration.md"
REGENERATE = "python scripts/gen_config_docs.py"
_SECTION = re.compile(r"^\s*# --- (.+)$")  # the dataclass's comment lines that group its fields
_MARKDOWN_SPECIAL = re.compile(r"([\\|*<\[\]])")  # what would end a table cell or start markup
_CODE_SPAN = re.compile(r"(`[^`]*`)")

_INTRO = f"""\
# Configuration

<!-- Generated from the field docstrings of TrainConfig (megatrain/config.py) by `{REGENERATE}`:
edit those, then regenerate; tests/test_docs.py fails while this page differs. -->

One YAML file plus `key=value` overrides on the command line (values parsed as YAML):

    megatrain train run.yaml learning_rate=2e-5 output_dir=output/try2

Names follow Hugging Face `TrainingArguments` (and TRL) where one exists. Unknown keys, keys given
twice and bad values (NaN and infinity included) are refused by name, before anything is written.
YAML reads unquoted `on`/`off`/`yes`/`no` as booleans: `gpu_state: off`, `report_to: no`,
`save_strategy: no` and `eval_strategy: no` mean what they say; elsewhere quote such values. The
true/false keys whose default is `auto` accept `auto` (or `null`). `megatrain train --help` prints
this table. What a run writes, evaluation and error handling: [Training runs](training.md).
"""


def default_text(f: dataclasses.Field) -> str:
    """A key's default as `--help` and the docs show it; "" where it is derived at run time (the
    docstring then says from what)."""
    d = f.default
    if d is None or d is dataclasses.MISSING:
        return ""
    return str(d).lower() if isinstance(d, bool) else str(d)


def sections() -> list[tuple[str, list[str]]]:
    """The documented keys in declaration order, grouped under the `# --- name` comments of the
    TrainConfig source."""
    source = inspect.getsource(TrainConfig)
    headings = {
        i + 1: m.group(1) for i, line in enumerate(source.splitlines()) if (m := _SECTION.match(line))
    }
    documented = key_docs()
    groups: list[tuple[str, list[str]]] = []
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name not in documented:
            continue
        heading = max((line for line in headings if line < node.lineno), default=None)
        title = headings[heading] if heading else "other"
        if not groups or groups[-1][0] != title:
            groups.append((title, []))
        groups[-1][1].append(name)
    return groups


def _cell(text: str) -> str:
    """Text for a table cell: markup characters escaped outside code spans; inside them (where a
    backslash is literal) only the pipe, which GitHub's tables split on even there."""
    parts = _CODE_SPAN.split(text)
    return "".join(
        p.replace("|", "\\|") if i % 2 else _MARKDOWN_SPECIAL.sub(r"\\\1", p) for i, p in enumerate(parts)
    )


def markdown() -> str:
    """The whole of docs/configuration.md."""
    docs = key_docs()
    defaults = {f.name: default_text(f) for f in dataclasses.fields(TrainConfig)}
    out = [_INTRO.rstrip("\n")]
    for title, names in sections():
        out += ["", f"## {title[0].upper()}{title[1:]}", "", "| key | default | meaning |", "|---|---|---|"]
        for name in names:
            default = f"`{defaults[name]}`" if defaults[name] else ""
            out.append(f"| `{name}` | {default} | {_cell(docs[name])} |")
    out += ["", "## Hugging Face keys megatrain does not take", "",
            "A config that brings one is refused before anything runs, with every such key it holds "
            "named in one line, and why:", "", "| key | why, and what to use |", "|---|---|"]  # fmt: skip
    out += [f"| `{k}` | {_cell(why)} |" for k, why in NOT_TAKEN.items()]
    return "\n".join(out) + "\n"
