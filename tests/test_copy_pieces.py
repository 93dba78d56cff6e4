"""Role files that copy alone: each imports in an empty folder that holds only it (and what it names), loads none
of yaml / transformers / config.py, and every block of docs/copy_a_piece.md (the README's "Copy a piece") runs there.

No role file imports config.py: config.py composes their settings (losses.LossSettings, buffer.BufferSettings),
train.py, workers.py, services.py and logger.py read the config (CONFIG_READERS; every other file at the root and
in standins/ and models/ is checked).
"""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_READERS = {"config.py", "train.py", "workers.py", "services.py", "logger.py",  # they read the config
                  "checks.py"}  # (its command, `python config.py check`, loads one)
ROLE_FILES = sorted(f for f in os.listdir(ROOT) if f.endswith(".py") and f not in CONFIG_READERS) + [
    f"{d}/{f}" for d in ("standins", "models") for f in sorted(os.listdir(os.path.join(ROOT, d))) if f.endswith(".py")]
# piece -> (the files it needs, modules that must not be loaded by importing it)
PIECES = {
    "losses": (["losses.py"], ["yaml", "transformers", "aiohttp", "orjson", "config"]),
    "logprobs": (["logprobs.py"], ["yaml", "transformers", "aiohttp", "orjson", "config"]),
    "strategies": (["strategies.py"], ["torch", "yaml", "transformers", "aiohttp", "orjson", "config"]),
    "staleness": (["staleness.py", "strategies.py"], ["torch", "yaml", "transformers", "aiohttp", "orjson", "config"]),
    "buffer": (["buffer.py", "strategies.py", "staleness.py"], ["yaml", "transformers", "aiohttp", "orjson", "config"]),
    "sglang_client": (["sglang_client.py"], ["torch", "yaml", "transformers", "config"]),
}


def _run(code_file: str, folder) -> subprocess.CompletedProcess:
    """The venv's python on a file in `folder`, cwd there, PYTHONPATH unset (-E): the folder is all it can import
    of this project."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([sys.executable, "-E", "-s", code_file], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def _imported_modules(path: str) -> set:
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("role", ROLE_FILES)
def test_no_role_file_imports_config(role):
    assert "config" not in _imported_modules(os.path.join(ROOT, role)), f"{role} imports config.py"


def test_config_imports_yaml_only_inside_functions():
    tree = ast.parse(open(os.path.join(ROOT, "config.py")).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert "yaml" not in {a.name for n in top for a in n.names} | {n.module for n in top
                                                                    if isinstance(n, ast.ImportFrom)}


def test_sglang_client_imports_only_stdlib_aiohttp_orjson():
    third_party = _imported_modules(os.path.join(ROOT, "sglang_client.py")) - set(sys.stdlib_module_names)
    assert third_party <= {"aiohttp", "orjson", "__future__"}, third_party


@pytest.mark.parametrize("piece", PIECES)
def test_piece_imports_alone(piece, tmp_path):
    files, banned = PIECES[piece]
    for f in files:
        shutil.copy(os.path.join(ROOT, f), tmp_path)
    (tmp_path / "probe.py").write_text(
        f"import sys\nimport {piece}\n"
        f"loaded = sorted(m for m in {banned!r} if m in sys.modules)\n"
        "assert not loaded, f'importing {piece} loaded {loaded}'\n")
    r = _run("probe.py", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


COPY_A_PIECE = "docs/copy_a_piece.md"  # the README's "Copy a piece" points here


def _copy_a_piece_blocks() -> list:
    text = open(os.path.join(ROOT, COPY_A_PIECE)).read()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_copy_a_piece_section_covers_every_piece():
    needs = [block.splitlines()[0] for block in _copy_a_piece_blocks()]
    assert all(line.startswith("# needs: ") for line in needs), needs
    named = {f for line in needs for f in line.split(":", 1)[1].split()}
    assert {f for files, _ in PIECES.values() for f in files} <= named, named  # a block for every piece


@pytest.mark.parametrize("index", range(len(_copy_a_piece_blocks())))
def test_copy_a_piece_block_runs_in_an_empty_folder(index, tmp_path):
    block = _copy_a_piece_blocks()[index]
    for f in block.splitlines()[0].split(":", 1)[1].split():
        shutil.copy(os.path.join(ROOT, f), tmp_path)
    (tmp_path / "demo.py").write_text(block)
    r = _run("demo.py", tmp_path)
    assert r.returncode == 0, f"{COPY_A_PIECE} block {index} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
