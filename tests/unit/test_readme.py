"""README agrees with the repository: the architecture table names real modules (at most 15), the test command is
the one CI runs, and the config groups it lists exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_architecture_table_lists_at_most_15_real_modules():
    section = README.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    modules = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert 5 <= len(modules) <= 15, modules
    for path in modules:
        assert (REPO / path).is_file(), path


def test_readme_test_command_is_what_ci_runs():
    command = "pip install -e '.[test]' && python -m pytest -q"
    assert command in README and command in (REPO / ".ci" / "run").read_text()


def test_listed_config_groups_exist():
    for group in re.findall(r"^    conf/(\w+)/ ", README, re.M):
        assert (REPO / "conf" / group).is_dir(), group
