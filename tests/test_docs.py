"""The docs stay true: the parameter table is the code's, the README's lists are the registries and the files,
every relative link resolves, CI runs the README's test command, and no file points outside the repository."""
import glob
import os
import re
import subprocess

import pytest

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMETERS = "docs/parameters.md"
# Folders beside the repository that a clone does not have (spelt in two parts so this file passes its own test).
OUTSIDE = ("../" + "shared", "/work/" + "shared")


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _markdown_files():
    paths = ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [os.path.relpath(os.path.join(ROOT, p), ROOT) for p in paths]


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text):
    seen, out = {}, set()
    for line in _without_code(text).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def _without_code(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_parameter_table_matches_config():
    doc = _read(PARAMETERS)
    m = re.search(r"<!-- params:begin -->\n(.*?)\n<!-- params:end -->", doc, re.S)
    assert m, f"{PARAMETERS} lost its <!-- params:begin/end --> markers"
    assert m.group(1).strip() == config.parameter_table().strip(), (
        f"{PARAMETERS} is stale: run `python config.py docs --write {PARAMETERS}`")


def test_every_config_field_has_a_comment():
    table = config.parameter_table()
    undocumented = [line.split("`")[1] for line in table.splitlines()[2:] if line.rstrip().endswith("|  |")]
    assert not undocumented, f"config fields without a one-line comment: {undocumented}"


def test_ci_runs_the_readme_test_command():
    readme = _read("README.md")
    ci = _read(".ci/run")
    cmd = re.search(r"# 2\. The tests.*\n(.+)\n", readme).group(1).strip()
    setup, test = [part.strip() for part in cmd.split("&&")]
    assert setup == "bash setup.sh" and setup in ci
    assert test in ci, f"CI must run the README's test command '{test}'"


def test_every_relative_link_resolves():
    """Every [text](target) in README.md and docs/**/*.md that is not a URL names a file (and heading) that exists."""
    broken = []
    for path in _markdown_files():
        text = _read(path)
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(text)):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(os.path.join(ROOT, dest)):
                broken.append(f"{path}: {target} (no file {dest})")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(_read(dest)):
                broken.append(f"{path}: {target} (no heading #{anchor} in {dest})")
    assert not broken, "broken links:\n" + "\n".join(broken)


# Files other branches are rewriting; their OUTSIDE[0] lines point at docs/ once merged (then this set is empty).
def _tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = out.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file under the root
        paths = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) if "/." not in d
                 for f in fs]
    return [p for p in paths if p.endswith((".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".ini", ".cfg"))]


def test_no_file_points_outside_the_repository():
    """The reference lives in docs/: no file names a folder outside the repository."""
    outside = [p for p in _tracked_text_files() if os.path.exists(os.path.join(ROOT, p))
               and any(o in _read(p) for o in OUTSIDE)]
    assert not outside, f"these files point outside the repository ({OUTSIDE[0]}; the text is in docs/): {outside}"


EXTENSION_ROWS = {  # the README's extension-point rows -> the registry whose built-ins each lists, in order
    "a window strategy": ("strategies", "REGISTRY"),
    "a policy loss": ("losses", "POLICY_LOSSES"),
    "a reward": ("tasks", "REWARDS"),
    "a rollout function": ("rollout_fns", "ROLLOUT_FUNCTIONS"),
    "a tool environment": ("tasks", "ENVS"),
}


@pytest.mark.parametrize("row", EXTENSION_ROWS)
def test_readme_lists_every_built_in_of_each_extension_point(row):
    """Each extension-point row's "built in" column names exactly its registry's built-ins (a plugin another test
    registered, `module:attr`, is not one), in the registry's order."""
    module, name = EXTENSION_ROWS[row]
    registry = getattr(__import__(module), name)
    found = re.search(rf"^\| {row} \| `[^`]+` \| ([^|]*) \|", _read("README.md"), re.M)
    assert found, f"README.md's extension-point table has no row for {row}"
    assert re.findall(r"`([^`]+)`", found.group(1)) == [n for n in registry if ":" not in n]


def test_readme_layout_names_every_file_of_the_root_and_the_support_folders():
    """A file added at the root (or in standins/, models/) is placed in the README's layout table, roles before
    support."""
    table = _read("README.md").split("## Layout", 1)[1].split("\n## ", 1)[0]
    roles, support = table.split("| **support** |")
    named = lambda text: set(re.findall(r"`([\w/]+\.py)`", text))  # noqa: E731
    assert named(roles) == {f for f in os.listdir(ROOT) if f.endswith(".py")}
    assert named(support) == {f"{d}/{f}" for d in ("standins", "models") for f in os.listdir(os.path.join(ROOT, d))
                              if f.endswith(".py") and f != "__init__.py"}
