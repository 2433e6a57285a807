"""The tiers of keras_comm import only downward, and no modules import each other.

Every module of the package is parsed with `ast` (imports inside functions
included), each import of keras_comm code is mapped to the module it loads,
and two rules are checked:

* a module imports only modules of its own tier or of the tiers below it, in
  the order `docs/architecture.md` draws (`TIERS`, lowest first);
* no import circle between modules.

No module is imported: the test reads source files, so it also runs on a tree
whose imports would fail.
"""

import ast
import importlib.util
import pathlib
import re

import pytest

# Lowest first; a module belongs to the first tier whose prefix it matches
# (the longest prefixes are listed, so ``keras_comm.ops._collective`` is
# "primitives" and ``keras_comm.ops.mirror`` is "ops").
TIERS = [
    ("_private", ["keras_comm._private"]),
    ("foundation", [
        "keras_comm._validation", "keras_comm.errors", "keras_comm.config",
        "keras_comm.topology", "keras_comm.watchdog",
    ]),
    ("variables", ["keras_comm.variables"]),
    ("primitives", ["keras_comm.ops._collective", "keras_comm.ops._fusion"]),
    ("ops", ["keras_comm.ops"]),
    ("layers", ["keras_comm.layers"]),
    ("parallel", ["keras_comm.parallel"]),
    ("distribution", ["keras_comm.distribution"]),
    ("training", ["keras_comm.training"]),
    ("callbacks", ["keras_comm.callbacks"]),
    ("compat", ["keras_comm.compat"]),
    ("package", ["keras_comm.launch", "keras_comm"]),
]


def _package_dir():
    spec = importlib.util.find_spec("keras_comm")  # locates, does not import
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _modules(package_dir):
    """``{dotted name: (path, is_package)}`` of every module under `package_dir`."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = ("keras_comm",) + path.relative_to(package_dir).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _imports(name, path, is_package, modules):
    """``[(target module, line)]``: the keras_comm modules `name` imports."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from package import module`` loads the module; ``from module
            # import name`` the module itself.
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import keras_comm.ops.x`` etc.
                target = target.rpartition(".")[0]
            if target and (target == "keras_comm" or target.startswith("keras_comm.")):
                out.append((target, node.lineno))
    return out


def _tier(module):
    best = None
    for index, (_, prefixes) in enumerate(TIERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no tier of TIERS: add it"
    return best[0]


def _graph(package_dir):
    modules = _modules(package_dir)
    graph = {}
    for name, (path, is_package) in modules.items():
        graph[name] = [
            (target, line)
            for target, line in _imports(name, path, is_package, modules)
            if target != name
        ]
    return modules, graph


def upward_imports(package_dir):
    """``["a (tier) -> b (tier), line n"]`` for every import of a higher tier."""
    modules, graph = _graph(package_dir)
    found = []
    for name, edges in graph.items():
        for target, line in edges:
            # A package's __init__ re-exports its own submodules.
            if target.startswith(name + "."):
                continue
            if _tier(target) > _tier(name):
                found.append(
                    f"{name} ({TIERS[_tier(name)][0]}) -> {target} "
                    f"({TIERS[_tier(target)][0]}), line {line}"
                )
    return found


def import_cycles(package_dir):
    """Every strongly connected set of two or more modules, sorted."""
    modules, graph = _graph(package_dir)
    # A package's __init__ loading its own submodules is left out: a
    # submodule importing a sibling through the package is no circle.
    edges = {
        name: sorted({t for t, _ in targets if not t.startswith(name + ".")})
        for name, targets in graph.items()
    }
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_module_has_a_tier():
    for name in _modules(_package_dir()):
        _tier(name)


def test_imports_point_down():
    found = upward_imports(_package_dir())
    assert not found, "Imports of a higher tier:\n" + "\n".join(found)


def test_no_import_circle():
    found = import_cycles(_package_dir())
    assert not found, "Modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_docs_draw_these_tiers():
    docs = pathlib.Path(__file__).resolve()
    while not (docs / "docs" / "architecture.md").exists():
        if docs.parent == docs:
            pytest.skip("docs/architecture.md is not in this checkout")
        docs = docs.parent
    text = (docs / "docs" / "architecture.md").read_text()
    diagram = re.search(r"## The tiers.*?```text\n(.*?)```", text, re.S).group(1)
    drawn = [line.split("tier:")[-1].split()[0] for line in diagram.splitlines() if "tier:" in line]
    # The diagram lists the tiers top first.
    assert drawn == [name for name, _ in reversed(TIERS)], drawn


def test_the_checks_catch_what_they_guard(tmp_path):
    package = tmp_path / "keras_comm"
    (package / "ops").mkdir(parents=True)
    (package / "training").mkdir()
    (package / "__init__.py").write_text("")
    (package / "ops" / "__init__.py").write_text("")
    (package / "training" / "__init__.py").write_text("")
    (package / "ops" / "mirror.py").write_text(
        "def f():\n    from keras_comm.training import step\n"
    )
    (package / "training" / "step.py").write_text("from keras_comm.training import loop\n")
    (package / "training" / "loop.py").write_text("from . import step\n")
    assert upward_imports(package) == [
        "keras_comm.ops.mirror (ops) -> keras_comm.training.step (training), line 2"
    ]
    assert import_cycles(package) == [["keras_comm.training.loop", "keras_comm.training.step"]]
