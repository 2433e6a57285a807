"""mkdocs hook: put the benchmark results on the performance page.

`python -m benchmarks.run --docs` writes docs/performance/benchmarks.md and
its plots (*.png). This hook replaces the ``<!-- benchmark-results -->``
marker of performance.md with links to that page and the plots when they
exist, and with instructions to generate them when they do not. The plots
are never drawn by hand.
"""

from pathlib import Path

MARKER = "<!-- benchmark-results -->"
PERF_DIR = Path(__file__).resolve().parent / "performance"


def _results_markdown():
    page = PERF_DIR / "benchmarks.md"
    plots = sorted(PERF_DIR.glob("*.png"))
    if not page.exists() and not plots:
        return (
            "!!! note \"No measured results in this build\"\n"
            "    docs/performance/ is empty: generate it on the machine you care about with\n"
            "    `python -m benchmarks.run --workers 2 --out results/ --docs`\n"
            "    (add `--quick` for a five-minute run), then rebuild the docs.\n"
        )
    lines = []
    if page.exists():
        lines.append("The full tables, with the machine they were measured on: "
                     "[measured results](performance/benchmarks.md).\n")
    for plot in plots:
        lines.append(f"![{plot.stem}](performance/{plot.name})\n")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, _results_markdown())
    return markdown
