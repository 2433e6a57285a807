"""mkdocs hooks: measured results from docs/results, the changelog, and maths.

Maths. pymdownx.arithmatex marks the formulas of the pages; MathJax 3 typesets
them in the reader's browser. Readers may be offline, so MathJax is not taken
from a CDN: its self-contained SVG build (one file, no web fonts) comes from
the `django-static-mathjax` package of the ``docs`` extra (plain static files,
no dependencies, despite the name) and is written into the built site next to
docs/javascripts/mathjax-config.js. Both scripts are added to every page.

Benchmarks. `python -m benchmarks.run --docs` writes its tables to docs/results/
(below) and its plots to docs/performance/*.png; benchmarks.md shows both.

Changelog. The repository's CHANGELOG.md becomes the site's changelog.md page.

Results. Every measured figure a guide quotes lives in one file,
docs/results/NAME.json: a title, the date, the machine, the command that
reproduces it, the columns and the rows. A page shows it with
``<!-- results: NAME -->`` (the whole table, dated, with its command and
machine) or quotes one cell with ``<!-- result: NAME | ROW | COLUMN -->``
(ROW is the row's first cell). Two pages quoting a figure therefore quote
the same file, and a marker that names no file, row or column fails the
build. tests/test_docs_results.py checks the files themselves.
"""

import html
import importlib.util
import json
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS_TABLE = re.compile(r"<!--\s*results:\s*([\w-]+)\s*-->")
RESULT_CELL = re.compile(r"<!--\s*result:\s*([\w-]+)\s*\|\s*(.+?)\s*\|\s*(.+?)\s*-->")
MATHJAX_CONFIG = "javascripts/mathjax-config.js"
MATHJAX_SITE_PATH = "javascripts/mathjax/tex-svg.js"


def _mathjax_file():
    """tex-svg.js of the installed MathJax package, or a PluginError saying how to get it."""
    spec = importlib.util.find_spec("mathjax")
    locations = spec.submodule_search_locations if spec else None
    for location in locations or []:
        path = Path(location) / "static" / "mathjax" / "es5" / "tex-svg.js"
        if path.is_file():
            return path
    raise PluginError(
        "MathJax is not installed, so the formulas of the docs would show as raw TeX: "
        "pip install -e '.[docs]' (it brings django-static-mathjax, MathJax 3's files)."
    )


def on_config(config):
    for script in (MATHJAX_CONFIG, MATHJAX_SITE_PATH):
        if script not in config.extra_javascript:
            config.extra_javascript.append(script)
    return config


CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"


def on_files(files, config):
    files.append(File.generated(config, MATHJAX_SITE_PATH, abs_src_path=str(_mathjax_file())))
    # The repository's CHANGELOG.md, shown as a page of the site (one file, two places).
    files.append(File.generated(config, "changelog.md", content=CHANGELOG.read_text()))
    return files


def load_results(name):
    """docs/results/NAME.json, or a PluginError naming the file."""
    path = RESULTS_DIR / f"{name}.json"
    if not path.is_file():
        raise PluginError(f"<!-- results: {name} -->: no file {path.name} in docs/results/")
    return json.loads(path.read_text())


def results_table(name):
    """The markdown of results file `name`: its table, then when, where and how it was measured."""
    data = load_results(name)
    columns = data["columns"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in data["rows"]:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    command = data["command"]
    if isinstance(command, list):
        command = " ".join(command)
    caption = (
        f"*{data['title']}.* Measured {data['date']} on {data['machine']}, with "
        f"`{command}`."
    )
    if data.get("note"):
        caption += " " + data["note"]
    return "\n".join(lines) + "\n\n" + caption + "\n"


def result_cell(name, row_key, column):
    """One cell of results file `name`: the row whose first cell is `row_key`, column `column`."""
    data = load_results(name)
    if column not in data["columns"]:
        raise PluginError(f"<!-- result: {name} | {row_key} | {column} -->: no column {column!r}; "
                          f"the columns are {data['columns']}")
    index = data["columns"].index(column)
    for row in data["rows"]:
        if str(row[0]) == row_key:
            return str(row[index])
    raise PluginError(f"<!-- result: {name} | {row_key} | {column} -->: no row {row_key!r}; "
                      f"the rows are {[str(r[0]) for r in data['rows']]}")


def render_results(markdown):
    """Replaces the page's results markers with the tables and cells they name."""
    markdown = RESULTS_TABLE.sub(lambda m: results_table(m.group(1)), markdown)
    return RESULT_CELL.sub(lambda m: html.unescape(result_cell(*m.groups())), markdown)


def on_page_markdown(markdown, page, config, files):
    return render_results(markdown)
