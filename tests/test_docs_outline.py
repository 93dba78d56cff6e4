"""The README's outline of a step ("## One step") is train.run_steps: the same calls in the same order."""
import ast
import inspect
import os
import re
import textwrap

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _calls(tree: ast.AST) -> list[str]:
    """The names of the calls in `tree` in source order ("rank0.fetch", "range", "Step")."""
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    return [ast.unparse(n.func) for n in calls]


def _run_steps_calls() -> list[str]:
    """run_steps' calls below its docstring."""
    [func] = ast.parse(textwrap.dedent(inspect.getsource(train.run_steps))).body
    return _calls(ast.Module(body=func.body[1:], type_ignores=[]))


def _outline_calls() -> list[str]:
    """The calls of the README's outline of a step: the first code block under "## One step", read as Python."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("\n## One step\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "README.md's \"## One step\" has no ```text outline"
    return _calls(ast.parse(block.group(1)))


def test_the_readme_outline_lists_run_steps_calls_in_order():
    code, outline = _run_steps_calls(), _outline_calls()
    # the phases of a step, in order: a run_steps that lost one does not pass by matching an outline that did too
    phases = ["rank0.fetch", "s.train", "rank0.pause", "s.checkpoint", "s.sync_weights", "rank0.resume"]
    assert [c for c in code if c in phases] == phases, code
    assert outline == code, f"README.md's outline calls {outline}, train.run_steps calls {code}"


def test_a_reordered_or_renamed_call_differs():
    """The comparison sees order and names, not only the set of calls."""
    src = "for c in range(n):\n    g = rank0.fetch(s, c)\n    s.train(g)\ns.sync_weights()\n"
    base = _calls(ast.parse(src))
    assert base == ["range", "rank0.fetch", "s.train", "s.sync_weights"]
    swapped = src.replace("g = rank0.fetch(s, c)\n    s.train(g)", "s.train(g)\n    g = rank0.fetch(s, c)")
    assert _calls(ast.parse(swapped)) != base
    assert _calls(ast.parse(src.replace("s.train(", "s.fit("))) != base
