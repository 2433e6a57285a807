"""User pages speak to users: no lab notebook in docs/*.md, README.md or examples/.

A user page says what to do and what holds now. How a result was reached
(which run, on which branch, under what load) belongs in git and in
CHANGELOG.md. This test fails on the marks such a history leaves:

* a machine path (``/tmp/...``, ``/work/...``, ``/root/...``): it exists on
  one machine only;
* the word "session" (of our work, not a user's);
* a reference to one of our issues ("issue 18", a bare ``#18``); an upstream
  reference names its repository (``keras-team/keras#20585``) and is fine;
* a load average;
* a commit hash.

The measured results the pages render (docs/results/*.json: their machine,
command and notes) are scanned too, and so is the saved benchmark output
docs/performance/ links to.

Advice that pages must agree on is checked here as well: no page sets
TensorFlow's per-op `timeout_seconds` on the strategy (it starts two threads
per collective for the whole timeout; `keras_comm.set_timeout` bounds steps).
"""

import re

import pytest

from _cluster import REPO_DIR

USER_PAGES = sorted((REPO_DIR / "docs").glob("*.md")) + [REPO_DIR / "README.md"] + sorted(
    (REPO_DIR / "examples").glob("*.py")
) + sorted((REPO_DIR / "docs" / "results").glob("*.json")) + sorted(
    (REPO_DIR / "docs" / "performance").rglob("*.json"))

RULES = {
    "a machine path": re.compile(r"(?<![\w.~<>-])/(?:tmp|work|root)/"),
    'the word "session"': re.compile(r"\bsessions?\b", re.I),
    "an issue reference of ours": re.compile(r"\bissues?\s+#?\d+|(?<![\w/.-])#\d+\b", re.I),
    "a load average": re.compile(r"\bload\s+(?:average\s+)?(?:of\s+)?\d|\bload averages?\b|\bloadavg", re.I),
    # A run of 7 to 40 hex digits holding both a digit and a letter a-f.
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
}


def _findings(text):
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in RULES.items():
            for match in pattern.finditer(line):
                found.append((number, what, match.group(0)))
    return found


# Pages being rewritten elsewhere, expected to pass once that rewrite lands
# (delete the entry then: strict=True makes a pass without deleting it fail).
BEING_REWRITTEN = {}


def _page_params():
    for page in USER_PAGES:
        name = str(page.relative_to(REPO_DIR))
        marks = [pytest.mark.xfail(reason=BEING_REWRITTEN[name], strict=True)] if name in BEING_REWRITTEN else []
        yield pytest.param(page, id=name, marks=marks)


@pytest.mark.parametrize("page", _page_params())
def test_user_page_reads_as_documentation_not_a_diary(page):
    found = _findings(page.read_text())
    assert not found, (
        f"{page.relative_to(REPO_DIR)} holds history that belongs in git or CHANGELOG.md, not a "
        "user page:\n" + "\n".join(f"  line {n}: {what}: {text!r}" for n, what, text in found)
    )


@pytest.mark.parametrize("text, what", [
    ("output in /tmp/peers11/drive.py", "a machine path"),
    ("PYTHONPATH=/work/venv316/bin/python", "a machine path"),
    ("main of session 11", 'the word "session"'),
    ("the target of issue 18 is not met", "an issue reference of ours"),
    ("fixed in #18", "an issue reference of ours"),
    ("load average 9 to 10", "a load average"),
    ("at load 15-27 on 2 cores", "a load average"),
    ("commit 4f5bf91 on branch epoch18", "a commit hash"),
])
def test_each_rule_catches_its_mark(text, what):
    assert what in {w for _, w, _ in _findings(text)}


@pytest.mark.parametrize("text", [
    "keras-team/keras#20585 and tensorflow/tensorflow#72388",
    "a float32 copy: 4 bytes per parameter, 2026-12-02",
    "docs/results/examples.json, keras_comm/parallel/flat_shard.py",
    "the load balances the experts; session_id is not a word here",
    "1e-07 relative, 0.9722, 3.6e-07, 209.8M parameters",
    "tempfile.gettempdir() and ~/tmp/x",
])
def test_ordinary_text_passes(text):
    assert _findings(text) == []


@pytest.mark.parametrize("page", [p for p in USER_PAGES if p.suffix in (".md", ".py")],
                         ids=lambda p: str(p.relative_to(REPO_DIR)))
def test_no_page_sets_the_per_op_timeout_on_the_strategy(page):
    found = [n for n, line in enumerate(page.read_text().splitlines(), 1)
             if re.search(r"timeout_seconds\s*=\s*\d", line)]
    assert not found, (
        f"{page.relative_to(REPO_DIR)} lines {found} set `timeout_seconds` on the strategy: "
        "advise `keras_comm.set_timeout(seconds)`, as every other page does")
