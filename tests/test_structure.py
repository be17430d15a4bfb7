"""The project's shape: imports point down the declared layer order, no import cycles between the project's own
modules, and no folder that holds most of the code.

The import graph is read from the source with ``ast`` (nothing is imported): every ``import`` statement counts,
module-level and inside functions, absolute and relative. An import points at the project module it names -- the
longest dotted prefix that is a project module; ``from pkg import name`` points at ``pkg/name.py`` when that file
exists, else at ``pkg/__init__.py``. A strongly connected component of more than one module is a cycle: modules that
cannot be understood, tested or moved one without the other.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_PROJECT = {"tests", "runs", "docs"}  # plus every hidden folder (.venv, .git, ...)
MAX_FOLDER_SHARE = 0.30

# The layer order of the top-level folders, highest first. A module may import its own folder and the folders of
# the layers below its own; never a folder of its own layer or of a layer above (so no two folders import each
# other). A new top-level folder must be placed here before its imports can pass.
LAYERS: list[tuple[str, ...]] = [
    ("cli", "experiments", "bench", "scripts"),  # entry points: the command line, experiment grids, benchmarks, ops
    ("flows", "diagnostics"),  # Prefect flows; research CLIs over the trainer's and engine's own code
    ("tasks", "tools"),  # thin Prefect tasks; command-line tools (export, comparisons, result files)
    ("cluster", "embedded"),  # Ray orchestration of the workers; the embedded demo's model, tokenizer and warm start
    ("rollout", "trainer"),  # the engine and the trainer (the Ray actors' code)
    ("data",),  # datasets, evaluation sets, the prompt format
    ("storage", "rewards"),  # checkpoints, hub snapshots, fsspec options; the tasks' rewards and verifiers
    ("process",),  # process plumbing and the TEST-ONLY hooks
    ("configs",),  # the recipes' schema
    ("fp8core",),  # FP8 numerics and the RL math, pure torch
]


def project_files(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every .py file in the project's top-level folders (and at the root)."""
    out: dict[str, Path] = {}
    for path in sorted(root.glob("*.py")):
        out[path.stem] = path
    for top in sorted(p for p in root.iterdir() if p.is_dir()):
        if top.name.startswith(".") or top.name in NOT_PROJECT:
            continue
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(part.startswith(".") for part in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _target(name: str, modules: set[str]) -> str | None:
    """The longest dotted prefix of ``name`` that is a project module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _imports(module: str, path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(project module imported, line) for every import statement in ``path``, at any depth."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [_target(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else _target(source, modules)
                       for alias in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t is not None and t != module]
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """(module -> the project modules it imports, (importer, imported) -> 'file:line' of the first such import)."""
    files = project_files(root)
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    where: dict[tuple[str, str], str] = {}
    for module, path in files.items():
        for target, line in _imports(module, path, modules):
            graph[module].add(target)
            where.setdefault((module, target), f"{path.relative_to(root)}:{line}")
    return graph, where


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (each sorted), iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component: [a, b, ..., a]."""
    inside, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def import_cycles(root: Path) -> list[str]:
    """One line per cycle: 'a -> b -> a  [a's file:line, b's file:line]' (plus the members of larger components)."""
    graph, where = import_graph(root)
    lines = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _shortest_cycle(graph, component)
        sites = ", ".join(where[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False))
        extra = f" (component of {len(component)}: {', '.join(component)})" if len(component) > len(cycle) - 1 else ""
        lines.append(f"{' -> '.join(cycle)}  [{sites}]{extra}")
    return lines


def folder_lines(root: Path) -> dict[str, int]:
    """Lines of .py code per top-level folder ('.' for files at the root)."""
    out: dict[str, int] = defaultdict(int)
    for path in project_files(root).values():
        rel = path.relative_to(root)
        out[rel.parts[0] if len(rel.parts) > 1 else "."] += len(path.read_text().splitlines())
    return dict(out)


def layer_violations(root: Path, layers: list[tuple[str, ...]]) -> list[str]:
    """One line per import that does not point down the layer order (module-level and function-level alike):
    'importer -> imported  [file:line] (layer of importer: i, of imported: j)', and one per top-level folder of
    project code that ``layers`` does not place."""
    rank = {folder: i for i, layer in enumerate(layers) for folder in layer}
    graph, where = import_graph(root)
    top = {m: m.split(".")[0] for m in graph}
    folders = {path.relative_to(root).parts[0] for path in project_files(root).values() if path.parent != root}
    lines = [f"{folder}/: not in the layer order (tests/test_structure.py LAYERS)" for folder in sorted(folders - set(rank))]
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            a, b = top[importer], top[imported]
            if a == b or a not in rank or b not in rank or rank[b] > rank[a]:
                continue
            lines.append(f"{importer} -> {imported}  [{where[(importer, imported)]}] "
                         f"({a}/ is in layer {rank[a]}, {b}/ in layer {rank[b]}: imports must point to a higher number)")
    return lines


def test_imports_point_down_the_layer_order():
    violations = layer_violations(ROOT, LAYERS)
    assert not violations, "imports that do not point down the layer order:\n" + "\n".join(violations)


TESTS_ONLY = {"ops"}  # tests/ops: the operations end-to-end tests, across rooms


def unmirrored(root: Path, layers: list[tuple[str, ...]]) -> list[str]:
    """Each placed folder and each sub-package (e.g. fp8core/rl) needs its tests/ folder; each tests/ folder must
    name a folder (or be one of TESTS_ONLY)."""
    placed = {folder for layer in layers for folder in layer}
    packages = placed | {str(init.parent.relative_to(root)) for folder in placed
                         for init in (root / folder).glob("*/__init__.py")}
    tests = {str(d.relative_to(root / "tests")) for d in (root / "tests").rglob("*") if d.is_dir()
             and any(d.glob("test_*.py"))}
    return ([f"{pkg}/ has no tests/{pkg}/" for pkg in sorted(packages - tests)]
            + [f"tests/{t}/ mirrors no folder" for t in sorted(tests - packages - TESTS_ONLY)])


def test_tests_mirror_the_folders():
    missing = unmirrored(ROOT, LAYERS)
    assert not missing, "tests/ does not mirror the project's folders:\n" + "\n".join(missing)


def test_the_layer_check_can_fail(tmp_path):
    """A function-level import from a lower folder into a higher one, an import within one layer, and a folder the
    order does not place are each reported with the import's file and line; pointing down passes."""
    for name, body in {"high": "import low.x\n", "mid": "", "low": ""}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    (tmp_path / "low" / "x.py").write_text("import os\n\n\ndef f():\n    from high import thing\n    return os, thing\n")
    layers = [("high",), ("mid",), ("low",)]
    assert layer_violations(tmp_path, layers) == [
        "low.x -> high  [low/x.py:5] (low/ is in layer 2, high/ in layer 0: imports must point to a higher number)"]
    (tmp_path / "low" / "x.py").write_text("import os\n")
    assert layer_violations(tmp_path, layers) == []
    (tmp_path / "mid" / "__init__.py").write_text("from high import thing\n")
    assert layer_violations(tmp_path, [("high", "mid"), ("low",)]) == [
        "mid -> high  [mid/__init__.py:1] (mid/ is in layer 0, high/ in layer 0: imports must point to a higher number)"]
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "y.py").write_text("")
    assert layer_violations(tmp_path, layers)[0] == "extra/: not in the layer order (tests/test_structure.py LAYERS)"


def test_no_import_cycles():
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles between project modules (importer -> imported):\n" + "\n".join(cycles)


def test_no_folder_holds_most_of_the_code():
    lines = folder_lines(ROOT)
    total = sum(lines.values())
    shares = {k: v / total for k, v in sorted(lines.items(), key=lambda kv: -kv[1])}
    table = ", ".join(f"{k} {s:.1%} ({lines[k]})" for k, s in shares.items())
    assert max(shares.values()) <= MAX_FOLDER_SHARE, (
        f"a folder holds more than {MAX_FOLDER_SHARE:.0%} of the {total} non-test Python lines: {table}")


def test_the_cycle_check_can_fail(tmp_path):
    """A two-module cycle whose back edge is a function-level relative import is found and spelled out; without it,
    no cycle. ``from pkg import name`` points at pkg/name.py, or at pkg/__init__.py when name is not a module."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "a.py").write_text("from pkg import b, VALUE\n")
    (pkg / "b.py").write_text("import os\n\n\ndef f():\n    from . import a\n    return a, os\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import pkg.a\n")  # tests are not part of the graph
    graph, _ = import_graph(tmp_path)
    assert graph == {"pkg": set(), "pkg.a": {"pkg", "pkg.b"}, "pkg.b": {"pkg.a"}}
    assert import_cycles(tmp_path) == ["pkg.a -> pkg.b -> pkg.a  [pkg/a.py:1, pkg/b.py:5]"]
    (pkg / "b.py").write_text("import os\n")
    assert import_cycles(tmp_path) == []


def test_longer_cycles_are_spelled_with_their_component(tmp_path):
    for name, body in {"x": "import y\n", "y": "from z import thing\n", "z": "import x.sub\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    (tmp_path / "x" / "sub.py").write_text("")
    assert import_cycles(tmp_path) == []  # z imports x.sub, not x
    (tmp_path / "x" / "sub.py").write_text("def f():\n    import y\n")
    assert import_cycles(tmp_path) == ["x.sub -> y -> z -> x.sub  [x/sub.py:2, y/__init__.py:1, z/__init__.py:1]"]


def test_the_mirror_check_can_fail(tmp_path):
    for d in ("a/sub", "tests/a/sub", "tests/stray"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "a" / "sub" / "__init__.py").write_text("")
    (tmp_path / "tests" / "a" / "sub" / "test_x.py").write_text("")
    (tmp_path / "tests" / "stray" / "test_y.py").write_text("")
    assert unmirrored(tmp_path, [("a", "b")]) == ["a/ has no tests/a/", "b/ has no tests/b/", "tests/stray/ mirrors no folder"]
    (tmp_path / "tests" / "a" / "test_z.py").write_text("")
    (tmp_path / "b").mkdir()
    (tmp_path / "tests" / "b").mkdir()
    (tmp_path / "tests" / "b" / "test_b.py").write_text("")
    (tmp_path / "tests" / "stray" / "test_y.py").unlink()
    assert unmirrored(tmp_path, [("a", "b")]) == []


# Product code (not the entry points' benchmarks, experiment grids, diagnostics or scripts) in pieces a reader can
# hold: modules of at most MAX_MODULE_LINES lines, functions of at most MAX_FUNCTION_LINES.
NOT_PRODUCT = {"bench", "experiments", "diagnostics", "scripts"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# function -> why it may be longer (each one a known debt, named where it is paid)
LONG_FUNCTIONS = {"fp8core/quant_chunked.py:_quantize_2d": "the quantizer's one pass; rewritten with the fused GEMM layout"}


def oversized(root: Path) -> list[str]:
    """``file: N lines`` for every product module over MAX_MODULE_LINES and ``file:function: N lines`` for every
    function over MAX_FUNCTION_LINES that LONG_FUNCTIONS does not name."""
    out = []
    for name, path in sorted(project_files(root).items()):
        if name.split(".")[0] in NOT_PRODUCT or "." not in name:
            continue
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_FUNCTIONS:
                    out.append(f"{rel}:{node.name}: {n} lines")
    return out


def test_product_modules_and_functions_fit_a_reader():
    assert oversized(ROOT) == [], f"split these (modules <= {MAX_MODULE_LINES}, functions <= {MAX_FUNCTION_LINES} lines)"


def test_the_size_check_can_fail(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "bench").mkdir()
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "trainer" / "big.py").write_text(f"def f():\n{long_body}\n" + "y = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "bench" / "big.py").write_text("y = 1\n" * (MAX_MODULE_LINES + 1))  # not product code
    assert oversized(tmp_path) == [f"trainer/big.py: {MAX_MODULE_LINES + MAX_FUNCTION_LINES + 1} lines",
                                   f"trainer/big.py:f: {MAX_FUNCTION_LINES + 1} lines"]
