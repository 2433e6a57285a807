"""The documentation: mkdocs' strict build, the API page, and every code block.

Code blocks in docs/*.md and README.md are run, according to an HTML
comment on the line just before the block's opening fence:

* no comment, or ``<!-- test: run -->``: ```` ```python ```` blocks run in one
  process, in page order, each page in a fresh namespace (a page's blocks
  build on each other, like a tutorial); ```` ```bash ```` blocks run with
  ``bash -euo pipefail`` from the repository root.
* ``<!-- test: cluster -->``: the python block is a script run on 2 local
  worker processes (tests/acceptance/blocks_worker.py);
  every worker must exit 0. All cluster blocks run in one launch, one after
  the other in fresh namespaces, sharing that launch's strategy (see
  `test_cluster_blocks`); a failing block is named by its file:line.
* ``<!-- test: skip REASON -->``: not run here; reported as a skipped test
  with its REASON (e.g. it needs GPUs or a Slurm allocation). A skip
  without a reason fails.

Blocks in ```` ```text ````, ```` ```json ```` or ```` ```yaml ```` are output or
data, not code; a block in any other language (or none) fails, so no code
escapes these rules. docs/performance/ holds only plots and saved numbers.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _cluster import REPO_DIR
from blocks_worker import run_blocks

DOCS = REPO_DIR / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md")) + [REPO_DIR / "README.md"]
RUNNABLE = {"python", "bash"}
DATA = {"text", "json", "yaml"}
_MARKER = re.compile(r"^<!--\s*test:\s*(run|cluster|skip)\b\s*(.*?)\s*-->$")
_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")


class Block:
    def __init__(self, page, line, lang, mode, reason, source):
        self.page, self.line, self.lang = page, line, lang
        self.mode, self.reason, self.source = mode, reason, source

    @property
    def label(self):
        return f"{self.page.relative_to(REPO_DIR)}:{self.line}"


def _blocks(page):
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{start + 1}: unclosed code fence")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k].strip()) if k >= 0 else None
        mode, reason = (marker.group(1), marker.group(2)) if marker else ("run", "")
        out.append(Block(page, start + 1, lang, mode, reason, "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in _blocks(page)]


def _ids(blocks):
    return [b.label for b in blocks]


def test_every_block_has_a_known_language_and_mode():
    bad = [f"{b.label}: ```{b.lang}" for b in ALL if b.lang not in RUNNABLE | DATA]
    assert not bad, f"code blocks must be one of {sorted(RUNNABLE | DATA)}: {bad}"
    unexplained = [b.label for b in ALL if b.mode == "skip" and not b.reason]
    assert not unexplained, f"`<!-- test: skip -->` needs a reason: {unexplained}"
    wrong = [b.label for b in ALL if b.mode == "cluster" and b.lang != "python"]
    assert not wrong, f"`<!-- test: cluster -->` is for python blocks: {wrong}"
    assert any(b.mode == "cluster" for b in ALL) and any(b.lang == "python" and b.mode == "run" for b in ALL)


# --- python blocks in one process ---------------------------------------

_RUNNER = """
import json, sys, traceback
pages = json.load(open(sys.argv[1]))
for page, blocks in pages.items():
    namespace = {"__name__": "__main__"}
    for label, source in blocks:
        print(f"--- {label}", flush=True)
        exec(compile(source, label, "exec"), namespace)
print("--- all blocks ran", flush=True)
"""

LOCAL_PYTHON = [b for b in ALL if b.lang == "python" and b.mode == "run"]


def test_python_blocks_run_in_one_process(tmp_path):
    pages = {}
    for b in LOCAL_PYTHON:
        pages.setdefault(str(b.page.relative_to(REPO_DIR)), []).append([b.label, b.source])
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(pages))
    runner = tmp_path / "runner.py"
    runner.write_text(_RUNNER)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(REPO_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(runner), str(spec)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and "--- all blocks ran" in proc.stdout, (
        f"a docs python block failed (the last '--- file:line' names it):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )


# --- python blocks on a 2-worker cluster --------------------------------
#
# One launch runs many cluster blocks, in page order, each in a fresh
# namespace (tests/acceptance/blocks_worker.py: a launch costs ~12 s of worker
# start-up, a block ~1-5 s; a failing block is named, and the blocks after it
# run in a fresh launch). The blocks of a launch share one strategy (the
# worker's docstring says why): the first block that creates its strategy
# with arguments runs first, and any further such block gets a launch of its
# own.

CLUSTER = [b for b in ALL if b.mode == "cluster"]
_STRATEGY_WITH_ARGS = re.compile(r"MultiWorkerMirroredStrategy\(\s*[^)\s]")


def cluster_launches(blocks):
    """The blocks of each launch (see above)."""
    with_args = [b for b in blocks if _STRATEGY_WITH_ARGS.search(b.source)]
    plain = [b for b in blocks if b not in with_args]
    return [with_args[:1] + plain] + [[b] for b in with_args[1:]]


@pytest.mark.multiprocess
def test_cluster_blocks(tmp_path):
    assert CLUSTER, "no `<!-- test: cluster -->` block found"
    outcome = {}
    for blocks in cluster_launches(CLUSTER):
        result, launches = run_blocks([[b.label, b.source] for b in blocks], tmp_path)
        outcome.update(result)
        # Each block's seconds (shown with -rP, or on a failure).
        for launch in launches:
            print("".join(line for line in launch.output.splitlines(True)
                          if line.startswith("[rank 0] --- ") and " ran in " in line))
    assert sorted(outcome) == sorted(b.label for b in CLUSTER)
    failures = [text for text in outcome.values() if text]
    assert not failures, (
        f"{len(failures)} cluster block(s) failed: "
        f"{[label for label, text in outcome.items() if text]}\n\n" + "\n\n".join(failures)
    )


# --- bash blocks ------------------------------------------------------------

SHELL = [b for b in ALL if b.lang == "bash" and b.mode == "run"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_bash_block(block):
    assert shutil.which("keras-comm-run") or "keras-comm-run" not in block.source, (
        "keras-comm-run is not on PATH: install the package (pip install -e .)"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.source], cwd=REPO_DIR, env=env,
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"{block.label} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


# --- blocks not run here, reported ---------------------------------------

SKIPPED = [b for b in ALL if b.mode == "skip"]


@pytest.mark.parametrize("block", SKIPPED, ids=_ids(SKIPPED))
def test_block_not_run_here(block):
    pytest.skip(f"{block.label} ({block.lang}): {block.reason}")


# --- the site -----------------------------------------------------------------


@pytest.fixture(scope="session")
def site(tmp_path_factory, request):
    """mkdocs' strict build, once per pytest session.

    pytest-xdist runs a session fixture once per worker process; the site
    tests land on both workers, so the first one to get here builds the site
    (under a lock in the session's shared temporary directory) and the other
    reads that build.
    """
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' to build the docs")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    import fcntl
    from types import SimpleNamespace

    # The session's directory: shared by its xdist workers (each has a
    # `workerinput`), not by other sessions.
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):
        root = root.parent
    out, record = root / "site", root / "site.json"
    with open(root / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
            proc = subprocess.run(
                [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300,
            )
            record.write_text(json.dumps(
                {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}))
    return SimpleNamespace(**json.loads(record.read_text())), out


def test_strict_build(site):
    proc, _ = site
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def test_api_page_renders_every_public_name(site):
    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    html = (out / "api" / "index.html").read_text()
    import keras_comm.callbacks
    import keras_comm.layers
    import keras_comm.ops
    import keras_comm.parallel

    import inspect

    modules = [keras_comm, keras_comm.layers, keras_comm.ops, keras_comm.callbacks, keras_comm.parallel]
    missing = []
    for m in modules:
        for name in m.__all__:
            if inspect.ismodule(getattr(m, name)):
                continue  # a subpackage: its own section
            # Rendered under the package, or under the module defining it
            # (a function named like its module, e.g. ops.all_reduce.all_reduce).
            anchor = re.compile(rf'id="{re.escape(m.__name__)}(\.\w+)?\.{re.escape(name)}"')
            if not anchor.search(html):
                missing.append(f"{m.__name__}.{name}")
    assert not missing, f"public names missing from docs/api.md's page: {missing}"


def _resolve(dotted):
    """The object a dotted keras_comm name names (importing its longest module prefix)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(dotted)


# Pages about keras_comm's internals, for contributors, may name private code.
_INTERNALS = {"architecture.md"}


def test_api_page_lists_every_name_the_guides_use(site):
    """A `keras_comm.x.y` a user page names resolves and has its entry on the API page."""
    import inspect

    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    ids = set(re.findall(r'id="([\w.]+)"', (out / "api" / "index.html").read_text()))
    used = {}
    for page in PAGES:
        if page.name in _INTERNALS:
            continue
        for match in re.finditer(r"`(keras_comm(?:\.\w+)+)", page.read_text()):
            if not any(part.startswith("_") for part in match.group(1).split(".")):
                used.setdefault(match.group(1), set()).add(page.name)
    problems = []
    for name, pages in sorted(used.items()):
        try:
            obj = _resolve(name)
        except (ImportError, AttributeError):
            problems.append(f"{name} ({', '.join(sorted(pages))}): no such name")
            continue
        if inspect.ismodule(obj):
            continue
        where = {name}
        if getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
            where.add(f"{obj.__module__}.{obj.__qualname__}")
        if not where & ids:
            problems.append(f"{name} ({', '.join(sorted(pages))}): not on docs/api.md's page")
    assert not problems, "names the guides use must be public and on the API page:\n" + "\n".join(problems)


# --- formulas ------------------------------------------------------------------
#
# pymdownx.arithmatex marks each formula (\( \), \[ \]) with class "arithmatex";
# MathJax, copied into the site by docs/_hooks.py, typesets them in the browser.
# A formula the extension missed, or a page without MathJax, shows raw TeX.

_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\\frac|\\sum|\\lceil")
_HIDDEN = re.compile(r"<(script|style|pre|code|textarea)\b.*?</\1>", re.S)
_MATH = re.compile(r'<(span|div) class="arithmatex">.*?</\1>', re.S)


def _visible_text(html):
    return re.sub(r"<[^>]+>", " ", _HIDDEN.sub(" ", html))


def _pages(out):
    return sorted(p for p in out.rglob("index.html") if p.parent != out / "search")


def test_formulas_are_marked_for_mathjax_and_mathjax_ships_with_the_site(site):
    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "javascripts" / "mathjax" / "tex-svg.js").stat().st_size > 100_000
    with_math = []
    for page in _pages(out):
        html = page.read_text()
        # Outside the marked formulas (and code), no TeX may be left to show raw.
        raw = _TEX.findall(_visible_text(_MATH.sub(" ", html)))
        assert not raw, f"{page.relative_to(out)}: TeX outside a formula, shown raw: {raw[:5]}"
        if 'class="arithmatex"' in html:
            with_math.append(page)
            scripts = re.findall(r'<script src="([^"]+)"', html)
            assert any(s.endswith("javascripts/mathjax-config.js") for s in scripts), page
            assert any(s.endswith("javascripts/mathjax/tex-svg.js") for s in scripts), page
            # The config must come first: MathJax reads window.MathJax when it loads.
            names = [s.rsplit("/", 1)[-1] for s in scripts]
            assert names.index("mathjax-config.js") < names.index("tex-svg.js"), page
    pages = {p.parent.name for p in with_math}
    assert {"performance", "parallel_optimizer", "concepts"} <= pages, pages


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.parametrize("page", ["performance", "parallel_optimizer", "parallelism"])
def test_formulas_render_in_a_browser(site, page, tmp_path):
    """Headless Chromium opens the built page from disk (offline) and MathJax typesets it."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (apt-get install chromium) to open the built site")
    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    html_file = out / page / "index.html"
    formulas = len(_MATH.findall(html_file.read_text()))
    assert formulas, f"{page} has no formulas to check"
    run = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path}", "--virtual-time-budget=15000", "--dump-dom",
         html_file.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    dom = run.stdout
    assert "</html>" in dom, f"chromium printed no page:\n{run.stderr[-2000:]}"
    typeset = dom.count("<mjx-container")
    assert typeset >= formulas, f"{page}: {typeset} of {formulas} formulas typeset"
    raw = _TEX.findall(_visible_text(dom))
    assert not raw, f"{page}: raw TeX left after MathJax ran: {raw[:5]}"
