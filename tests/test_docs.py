"""The README stays true: its parameter table is the code's, and CI runs the README's test command."""
import os
import re

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_readme_parameter_table_matches_config():
    readme = _read("README.md")
    m = re.search(r"<!-- params:begin -->\n(.*?)\n<!-- params:end -->", readme, re.S)
    assert m, "README.md lost its <!-- params:begin/end --> markers"
    assert m.group(1).strip() == config.parameter_table().strip(), (
        "README parameter table is stale: run `python config.py docs --write README.md`")


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
