"""mkdocs hooks: the benchmark results on the performance page, and maths.

Maths. pymdownx.arithmatex marks the formulas of the pages; MathJax 3 typesets
them in the reader's browser. Readers may be offline, so MathJax is not taken
from a CDN: its self-contained SVG build (one file, no web fonts) comes from
the `django-static-mathjax` package of the ``docs`` extra (plain static files,
no dependencies, despite the name) and is written into the built site next to
docs/javascripts/mathjax-config.js. Both scripts are added to every page.

Benchmarks. `python -m benchmarks.run --docs` writes docs/performance/benchmarks.md and
its plots (*.png). This hook replaces the ``<!-- benchmark-results -->``
marker of performance.md with links to that page and the plots when they
exist, and with instructions to generate them when they do not. The plots
are never drawn by hand.
"""

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

MARKER = "<!-- benchmark-results -->"
PERF_DIR = Path(__file__).resolve().parent / "performance"
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


def on_files(files, config):
    files.append(File.generated(config, MATHJAX_SITE_PATH, abs_src_path=str(_mathjax_file())))
    return files


_SPREAD = "Error bars: p10–p90 of the timed iterations (the run-to-run spread)."
PLOT_CAPTIONS = {
    "busbw_2workers": ("Bus bandwidth, 2 workers",
                       "keras_comm's layers against TensorFlow's raw collectives and MPI. " + _SPREAD),
    "busbw_4workers": ("Bus bandwidth, 4 workers",
                       "Four workers on two cores: time-sharing shows as much as communication. "
                       + _SPREAD),
    "overhead_2workers": ("Layer overhead, 2 workers",
                          "keras_comm time / raw TF time, paired iteration by iteration; the dashed "
                          "line is the 1.05 target. Error bars: p10–p90 of the paired ratios."),
    "overhead_4workers": ("Layer overhead, 4 workers",
                          "As above, on 4 workers. Error bars: p10–p90 of the paired ratios."),
    "reduce_scatter": ("ReduceScatter on CPU",
                       "All-to-all plus a local sum against an all-reduce followed by a slice."),
    "training_scaling": ("model.fit throughput",
                         "Samples per second with a fixed per-replica batch. Error bars: the "
                         "slowest and fastest round."),
    "parallel_optimizer": ("ParallelOptimizer: time and optimizer state",
                           "Top: time per sample (error bars: slowest and fastest round). Bottom: "
                           "the optimizer state each replica holds, by part; plain `fit` holds "
                           "Adam's two moments, ZeRO-1 and 2 hold half of them on 2 workers."),
}


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
    # In the order of the tables (the captions' order), then any others.
    order = list(PLOT_CAPTIONS)
    plots.sort(key=lambda plot: (order.index(plot.stem) if plot.stem in order else len(order), plot.name))
    for plot in plots:
        title, caption = PLOT_CAPTIONS.get(plot.stem, (plot.stem.replace("_", " "), ""))
        lines.append(f"### {title}\n")
        lines.append(f"![{title}](performance/{plot.name})\n")
        if caption:
            lines.append(f"{caption}\n")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, _results_markdown())
    return markdown
