"""The root's layout: no import cycle among its modules (imports inside functions included), no file over 1,000
lines and train.py within 600, no function over 80 lines, and no script folder file named like a root module."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT_MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and os.path.isfile(os.path.join(ROOT, f)))


def _root_imports(module: str) -> set:
    """The root modules that `module` imports anywhere in its file: at the top, inside functions, under if."""
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, module + ".py")).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ROOT_MODULES) - {module}


def _cycle(graph: dict):
    """One cycle of `graph` ({node: set of nodes}) as a list of nodes that starts and ends at the same one, or None
    (depth-first search; a node met again while still on the path closes a cycle)."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            found = visit(nxt)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d"}}) == ["d", "d"]


def test_no_import_cycle_among_root_modules():
    """What two root modules both need lives in a third that imports neither (style principle 14)."""
    assert {"train", "checkpoint", "weight_sync", "hf_export", "remote"} <= set(ROOT_MODULES)
    cycle = _cycle({m: _root_imports(m) for m in ROOT_MODULES})
    assert cycle is None, f"import cycle among the root's modules: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", ROOT_MODULES)
def test_no_root_file_exceeds_1000_lines_and_train_py_600(module):
    """train.py is the loop and its start-up; what grows beside them belongs to a role of its own."""
    with open(os.path.join(ROOT, module + ".py")) as f:
        lines = sum(1 for _ in f)
    limit = 600 if module == "train" else 1000
    assert lines <= limit, f"{module}.py has {lines} lines, over {limit:,}: split a role out"



def _long_functions(source: str, limit: int) -> list:
    """(name, first line, length) of every function or method in `source` longer than `limit` lines."""
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_long_function_finder_counts_lines():
    body = "def f():\n" + "    x = 1\n" * 80 + "\nclass C:\n    async def g(self):\n        pass\n"
    assert _long_functions(body, 80) == [("f", 1, 81)]
    assert _long_functions(body, 81) == []


@pytest.mark.parametrize("module", ROOT_MODULES)
def test_no_root_function_exceeds_80_lines(module):
    """A function is read at once: one that does several jobs is split into named parts (style: short functions)."""
    with open(os.path.join(ROOT, module + ".py")) as f:
        long = _long_functions(f.read(), 80)
    assert not long, f"{module}.py: functions over 80 lines: {long}; split them into named parts"

def test_no_script_folder_file_shadows_a_root_module():
    """bench/, examples/ and tests/ go on sys.path when their scripts run (bench/pipeline_sim.py imports train.py):
    a file there named like a root module would be imported in its place (bench/preemption.py once hid
    preemption.py from train.run_steps)."""
    clashes = {d: sorted(set(f[:-3] for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py"))
                         & set(ROOT_MODULES)) for d in ("bench", "examples", "tests")}
    assert not any(clashes.values()), f"files named like a root module: {clashes}"
