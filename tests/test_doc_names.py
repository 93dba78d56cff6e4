"""The docs name code that exists: every `module.function`, `module.Class.method`, `Class.method`, `file.py`,
`file.py:function` and `module:attr` (a plugin) in README.md and docs/*.md (docs/results/ is history: not read), in
a code span or a text/python code block, that names a root module or a file of standins/, models/, bench/,
examples/ or tests/, resolves. Names are looked up in the files' syntax trees (nothing is imported but config, whose
dataclass tree says which dotted names are config keys: `rollout.pause_mode` is a key, not an attribute of
rollout.py).

Run: .venv/bin/python -m pytest -q -n 0 tests/test_doc_names.py"""
import ast
import dataclasses
import functools
import glob
import os
import re
import typing

import pytest

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("standins", "models", "bench", "examples", "tests")  # besides the root; `standins.engine` is a module too
# A dotted name ending in one of these is a file name (`config.yaml`, `metrics.jsonl`), not an attribute.
FILE_SUFFIXES = {"yaml", "yml", "json", "jsonl", "gz", "pt", "md", "txt", "log", "png", "sh", "ini", "cfg", "toml",
                 "safetensors", "bin", "gguf", "tmp", "lease", "lock", "pid", "csv", "html", "whl", "so"}


def _docs():
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _code(text):
    """(inline code spans, lines of the text / python / unlabelled fenced blocks) of a markdown text."""
    fence = r"^```(\w*)\n(.*?)^```"
    blocks = [line for lang, body in re.findall(fence, text, flags=re.S | re.M) if lang in ("", "text", "python")
              for line in body.splitlines()]
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(fence, "", text, flags=re.S | re.M))
    return spans, blocks


@functools.lru_cache(maxsize=None)
def _modules():
    """Module name -> file: the root's .py files by their stem, the folders' as `folder.stem` (a bare stem of a
    folder's file is not looked up: `scheduler.py` may be SGLang's; the docs write `standins/scheduler.py`)."""
    out = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")}
    for d in FOLDERS:
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith(".py") and f != "__init__.py":
                out[f"{d}.{f[:-3]}"] = f"{d}/{f}"
    return out


def _names_in(body, into, self_attrs=False):
    """Top-level names a block defines (functions, classes, assignments, imports), looking into if/try/with."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            into.setdefault(node.name, node)
            if self_attrs and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):  # self.x = ... in a method: an instance attribute
                    targets = sub.targets if isinstance(sub, ast.Assign) else (
                        [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            into.setdefault(t.attr, t)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        into.setdefault(n.id, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                into.setdefault((a.asname or a.name).split(".")[0], node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for part in getattr(node, block, []):
                    _names_in(part.body if isinstance(part, ast.ExceptHandler) else [part], into, self_attrs)
    return into


@functools.lru_cache(maxsize=None)
def _top_level(module):
    with open(os.path.join(ROOT, _modules()[module])) as f:
        return _names_in(ast.parse(f.read()).body, {})


@functools.lru_cache(maxsize=None)
def _classes():
    """Class name -> [(module, ClassDef)] over the root's modules and standins/ and models/ (the scripts' and tests'
    classes are not the docs' `Class.method`)."""
    out = {}
    for m in _modules():
        if m.split(".")[0] in ("bench", "examples", "tests"):
            continue
        for name, node in _top_level(m).items():
            if isinstance(node, ast.ClassDef):
                out.setdefault(name, []).append((m, node))
    return out


@functools.lru_cache(maxsize=None)
def _class_attrs(module, cls, seen=()):
    """What a class has: its body's names, its methods' self attributes, and its bases' (found by name)."""
    names = set(_names_in(cls.body, {}, self_attrs=True))
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        node = _top_level(module).get(base_name)
        candidates = [(module, node)] if isinstance(node, ast.ClassDef) else _classes().get(base_name, [])
        for m, b in candidates:
            if (m, b.name) not in seen:
                names |= _class_attrs(m, b, seen + ((module, cls.name),))
    return names


FOUND = ast.Pass()  # a class attribute found in a base class: defined, and nothing to walk into


def _resolves_in(module, parts):
    """parts (attribute names) resolve in module, each defined where the one before it points. A function, an assigned
    value or an imported name ends the walk: what follows is its attribute, not looked up."""
    node = _top_level(module).get(parts[0])
    for part in parts[1:]:
        if not isinstance(node, ast.ClassDef):
            return node is not None
        if part not in _class_attrs(module, node):
            return False
        node = _names_in(node.body, {}, self_attrs=True).get(part, FOUND)
    return node is not None


@functools.lru_cache(maxsize=None)
def _config_fields(tp):
    """A config section's fields and their types (list[X], Optional[X], X | None unwrapped); None for a leaf."""
    while typing.get_origin(tp) is not None:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else None


def _an_instance_has(module, name):
    """`buffer.update_aborts()`, `rollout.pause()`: the docs' name for an object of one of the module's classes."""
    return any(isinstance(node, ast.ClassDef) and name in _class_attrs(module, node)
               for node in _top_level(module).values())


def _is_config_key(parts):
    """parts name a config key (or a section): rollout.sampling.temperature, rollout.server_layout[].node; or a
    key the config refuses naming its new one (config.RENAMED_SETTINGS)."""
    if ".".join(parts) in config.RENAMED_SETTINGS:
        return True
    hints = _config_fields(config.Config)
    for i, part in enumerate(parts):
        part = part.removesuffix("[]")
        if hints is None or part not in hints:
            return False
        if i < len(parts) - 1:
            hints = _config_fields(hints[part])
    return True


def _file_defines(path, name):
    return _resolves_in(next(m for m, p in _modules().items() if p == path), name.split("."))


# The names the docs give objects: `ctx.generate(traj)` is a method of rollout_fns.RolloutContext, and on the stand-in
# engine's page `engine.launch` and `scheduler.broadcast_tensors` are standins/engine.py's and standins/scheduler.py's.
ALIASES = {"ctx": "rollout_fns.RolloutContext", "traj": "buffer.Trajectory"}
PAGE_ALIASES = {"docs/engine.md": {"engine": "standins.engine", "scheduler": "standins.scheduler"}}

# `file.py`, `folder/file.py`, each optionally followed by `:name`, `::name` (a test) or, in a code span, `: name`
FILE = r"(?<![\w/.-])((?:(?:" + "|".join(FOLDERS) + r")/)?[A-Za-z_]\w*\.py)"
FILE_REF = {True: re.compile(FILE + r"(?:::?\s?([A-Za-z_][\w.]*))?"),
            False: re.compile(FILE + r"(?:::?([A-Za-z_][\w.]*))?")}
# `module:attr`, the plugin form (`strict_fifo:StrictFifo`, with PYTHONPATH=examples): a root module or an example's
PLUGIN = re.compile(r"(?<![\w/.:-])([A-Za-z_]\w*):([A-Za-z_]\w*)\b")
# a dotted name, not inside a path (`run_dir/config.yaml`), a longer dotted name or after a colon
DOTTED = re.compile(r"(?<![\w/.:-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*(?:\[\])?)+)(?![\w/-])")


def _problems(span, page=None, in_span=True):
    """What in one code span, or one line of a code block (in_span False), of the doc page does not resolve."""
    out = []
    for path, name in FILE_REF[in_span].findall(span):
        if "/" not in path and not os.path.exists(os.path.join(ROOT, path)):
            continue  # not a root file: another project's (`fully_async_rollouter.py`, SGLang's `scheduler.py`)
        if not os.path.exists(os.path.join(ROOT, path)):
            out.append(f"{path}: no such file")
        elif name and not _file_defines(path, name):
            out.append(f"{path}:{name}: {path} defines no {name}")
    without_files = FILE_REF[in_span].sub(" ", span)
    for name, attr in PLUGIN.findall(without_files):
        module = next((m for m in (name, f"examples.{name}") if m in _modules()), None)
        if module and not _resolves_in(module, [attr]):
            out.append(f"{name}:{attr}: {_modules()[module]} defines no {attr}")
    for dotted in DOTTED.findall(without_files):
        parts = [p.removesuffix("[]") for p in dotted.split(".")]
        alias = {**ALIASES, **PAGE_ALIASES.get(page, {})}.get(parts[0])
        parts = alias.split(".") + parts[1:] if alias else parts
        if parts[-1] in FILE_SUFFIXES:
            continue
        first = parts[0]
        modules = [m for m in _modules() if m == first or m == ".".join(parts[:2])]
        if _is_config_key(dotted.split(".")) or (first == "cfg" and _is_config_key(dotted.split(".")[1:])):
            continue
        if modules:
            module = max(modules, key=len)
            rest = parts[len(module.split(".")):]
            if rest and not _resolves_in(module, rest) and not _an_instance_has(module, rest[0]):
                out.append(f"{dotted}: {_modules()[module]} defines no {'.'.join(rest)}")
        elif first in _classes():
            if not any(parts[1] in _class_attrs(m, c) for m, c in _classes()[first]):
                where = ", ".join(_modules()[m] for m, _ in _classes()[first])
                out.append(f"{dotted}: class {first} ({where}) has no {parts[1]}")
    return out


def _drift(paths):
    found = []
    for path in paths:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        spans, block_lines = _code(text)
        found += [f"{path}: `{span}`: {p}" for span in spans for p in _problems(span, path)]
        found += [f"{path}: {line.strip()!r}: {p}" for line in block_lines for p in _problems(line, path, False)]
    return found


def test_every_code_name_in_the_docs_exists():
    """A function, class, method or file renamed or removed in the code is caught where the docs still name it."""
    drift = _drift(_docs())
    assert not drift, "the docs name code that does not exist:\n" + "\n".join(drift)


@pytest.mark.parametrize("span, problem", [
    ("buffer.PipelineServer.step_boundary_renamed", "buffer.py defines no PipelineServer.step_boundary_renamed"),
    ("losses.no_such_loss", "losses.py defines no no_such_loss"),
    ("PipelineServer.no_such_method()", "class PipelineServer (buffer.py) has no no_such_method"),
    ("standins.tiny_model.no_such_function", "standins/tiny_model.py defines no no_such_function"),
    ("no_such_file.py", None),  # not a file of this project's root by that name: another project's
    ("bench/no_such_bench.py", "bench/no_such_bench.py: no such file"),
    ("losses.py:no_such_function", "losses.py defines no no_such_function"),
    ("rollout.no_such_key=3", "rollout.py defines no no_such_key"),
    ("await ctx.no_such_call(traj)", "rollout_fns.py defines no RolloutContext.no_such_call"),
    ("fully_async.sliding_window=strict_fifo:StrictFifo2", "examples/strict_fifo.py defines no StrictFifo2"),
])
def test_a_renamed_name_is_caught(span, problem):
    found = _problems(span)
    assert (found == []) if problem is None else any(problem in p for p in found), found


def test_a_code_block_is_read_too_and_a_colon_there_is_prose():
    assert _problems("    actor.sync_weights_renamed(step + 1)  # checkpoint.py: weights", None, False) == [
        "actor.sync_weights_renamed: actor.py defines no sync_weights_renamed"]


@pytest.mark.parametrize("span", [
    "rollout.pause_mode", "rollout.sampling.temperature=1.0", "rollout.server_layout[].node", "cfg.trainer.lr",
    "buffer.PipelineServer.step_boundary", "staleness.decide", "remote.Proxy(worker, timeout, remote.BUFFER_METHODS)", "run_dir/config.yaml",
    "standins.tiny_model.make_tiny_model", "losses.py", "bench/pipeline_sim.py --sweep", "model.path",
    "torch.distributed.checkpoint", "utils/common.py: get_bool_env_var",
    "fully_async.sliding_window=strict_fifo:StrictFifo", "rollout.env=module:YourEnv",
])
def test_what_exists_and_what_is_not_ours_passes(span):
    assert _problems(span) == []
