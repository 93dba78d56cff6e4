"""The docs stay true: the parameter table is the code's, every relative link resolves, CI runs the README's test
command, and nothing the docs or configs say points outside the repository."""
import glob
import os
import re

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMETERS = "docs/parameters.md"


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


def test_docs_name_no_path_outside_the_repository():
    """The reference lives in docs/: README, docs, configs, bench and engine.py point at nothing outside the repo."""
    paths = _markdown_files() + sorted(os.path.relpath(p, ROOT) for pattern in ("configs/*.yaml", "bench/*.py",
                                                                             "bench/*.sh", "engine.py")
                                       for p in glob.glob(os.path.join(ROOT, pattern)))
    outside = [p for p in paths if "../shared" in _read(p) or "/work/shared" in _read(p)]
    assert not outside, f"these files point outside the repository (../shared): {outside}"
