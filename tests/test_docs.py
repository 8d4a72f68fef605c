"""The documentation, checked like code: the configuration page is the one generated from the
config's docstrings, every relative link resolves (files moved or renamed show up here), every
figure the README links is in the result file it links to, and every result file is indexed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatrain.config import key_docs
from megatrain.configdocs import PAGE, REGENERATE, _cell, markdown, sections

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md", RESULTS / "README.md"]
PAGES.append(ROOT / "examples" / "README.md")
README_LINES = 220  # a product page; the depth lives in docs/

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _prose(text: str) -> str:
    """Markdown without fenced blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(page: Path) -> list[tuple[str, str]]:
    return _LINK.findall(_prose(page.read_text()))


def _anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for title in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_the_configuration_page_is_the_generated_one():
    page = ROOT / PAGE
    assert page.is_file() and page.read_text() == markdown(), (
        f"{PAGE} differs from the docstrings of megatrain/config.py: run `{REGENERATE}` and commit it"
    )


def test_the_configuration_page_lists_every_key_once_in_declaration_order():
    assert [name for _, names in sections() for name in names] == list(key_docs())
    page = markdown()
    for name in key_docs():
        assert page.count(f"| `{name}` |") == 1, name


@pytest.mark.parametrize(
    "text,cell",
    [
        ("0 <= seed < 2**32", r"0 \<= seed \< 2\*\*32"),  # not emphasis, not a tag
        ("a | b in `x|y`", r"a \| b in `x\|y`"),  # a pipe ends a cell even inside code
        ("`checkpoint-*` and checkpoint-*", r"`checkpoint-*` and checkpoint-\*"),  # code is literal
    ],
)
def test_a_docstring_becomes_one_table_cell(text, cell):
    assert _cell(text) == cell


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page):
    broken = []
    for _, target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_product_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines: move the depth to docs/"
    docs = {target for _, target in _links(README) if target.startswith("docs/")}
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in docs, f"README.md does not link docs/{page.name}"


def test_every_figure_the_readme_links_is_in_its_result_file():
    """The results table's cells are links; each number in a link to bench/results must appear in
    that file (digits as written there: 23,754 not 23.8k), so the README cannot drift from what
    was measured."""
    checked = 0
    for text, target in _links(README):
        if not target.startswith("bench/results/"):
            continue
        record = (ROOT / target).read_text()
        for number in _NUMBER.findall(text):
            assert number in record, f"README.md: {number} ({text!r}) is not in {target}"
            checked += 1
    assert checked >= 20  # the results table is there and links its figures


def test_every_result_row_of_the_readme_links_a_result_file():
    table = README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert rows
    for row in rows:
        assert "](bench/results/" in row, row


def test_every_result_file_is_in_the_results_index():
    index = (RESULTS / "README.md").read_text()
    listed = {target for _, target in _LINK.findall(index)}
    missing = sorted(
        p.name
        for p in RESULTS.iterdir()
        if not p.name.startswith(".") and p.name != "README.md" and p.name not in listed
    )
    assert not missing, f"bench/results/README.md does not list {missing}: add a line for each run"
