"""docs/results/*.json: the one home of every measured figure the guides quote.

docs/_hooks.py renders ``<!-- results: NAME -->`` as the file's table (with
its date, machine and command) and ``<!-- result: NAME | ROW | COLUMN -->`` as
one cell, so pages quoting a figure cannot disagree. Here: every file is
complete and used, and every marker names a file, row and column that exist
(the strict build fails on them too; this says which without building).
"""

import json
import re
import sys

import pytest

from _cluster import REPO_DIR

DOCS = REPO_DIR / "docs"
RESULTS = sorted((DOCS / "results").glob("*.json"))
PAGES = sorted(DOCS.glob("*.md")) + [REPO_DIR / "README.md"]

sys.path.insert(0, str(DOCS))
try:
    import _hooks  # noqa: E402  (needs mkdocs)
except ImportError:  # pragma: no cover - the docs extra is not installed
    _hooks = None


def _markers():
    text = {page: page.read_text() for page in PAGES}
    tables = [(p, m.group(1)) for p, t in text.items() for m in re.finditer(r"<!--\s*results:\s*([\w-]+)\s*-->", t)]
    cells = [(p, m.groups()) for p, t in text.items()
             for m in re.finditer(r"<!--\s*result:\s*([\w-]+)\s*\|\s*(.+?)\s*\|\s*(.+?)\s*-->", t)]
    return tables, cells


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_results_file_is_complete(path):
    data = json.loads(path.read_text())
    for key in ("title", "date", "machine", "command", "columns", "rows"):
        assert data.get(key), f"{path.name}: no {key!r}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]), f"{path.name}: date {data['date']!r} is not YYYY-MM-DD"
    assert len(set(data["columns"])) == len(data["columns"]), f"{path.name}: two columns share a name"
    keys = [str(row[0]) for row in data["rows"]]
    assert len(set(keys)) == len(keys), f"{path.name}: two rows share their first cell"
    for row in data["rows"]:
        assert len(row) == len(data["columns"]), f"{path.name}: row {row[0]!r} has {len(row)} cells"


def test_every_results_file_is_shown_and_every_marker_resolves():
    tables, cells = _markers()
    names = {p.stem for p in RESULTS}
    used = {name for _, name in tables} | {groups[0] for _, groups in cells}
    assert not names - used, f"results files no page shows: {sorted(names - used)}"
    missing = [f"{p.name}: {name}" for p, name in tables if name not in names]
    missing += [f"{p.name}: {groups[0]}" for p, groups in cells if groups[0] not in names]
    assert not missing, f"markers naming no docs/results/ file: {missing}"
    if _hooks is None:
        pytest.skip("mkdocs is not installed: the cells are checked by the strict build only")
    for page, (name, row, column) in cells:
        _hooks.result_cell(name, row, column)  # raises naming what is missing


def test_every_plot_is_shown_and_every_plot_shown_exists():
    """The plots `benchmarks.run --docs` writes into docs/performance/ belong to the tables of
    docs/results/: a plot no page shows would be left over from some other run."""
    shown = {m.group(1) for page in PAGES for m in re.finditer(r"\]\((performance/[^)\s]+\.png)\)", page.read_text())}
    present = {str(p.relative_to(DOCS)) for p in (DOCS / "performance").rglob("*.png")}
    assert not present - shown, f"plots no page shows: {sorted(present - shown)}"
    assert not shown - present, f"plots a page shows that do not exist: {sorted(shown - present)}"


@pytest.mark.parametrize("name", ["po_memory_42m", "po_memory_200m"])
def test_memory_tables_are_what_the_report_makes_of_the_saved_numbers(name):
    """The memory tables come from docs/performance/memory/memory.json (the memory family of
    several `benchmarks.run` launches) through `benchmarks.report`, not by hand."""
    sys.path.insert(0, str(REPO_DIR))
    from benchmarks import report

    saved = json.loads((DOCS / "performance" / "memory" / "memory.json").read_text())
    made = report.memory_tables(saved)[name]
    shown = json.loads((DOCS / "results" / f"{name}.json").read_text())
    assert (shown["columns"], shown["rows"]) == (made["columns"], made["rows"])
