"""The test helpers under concurrency: two test runs at once never hand the same port to two recipes, and no
recipe a test starts writes into a directory of the repository that another run would share."""

from __future__ import annotations

import ast

import pytest

from tests.e2e.helpers import REPO, check_output_dir, reserved_port


def test_a_held_port_is_skipped():
    probes = iter([40001, 40001, 40002])  # the second reservation first probes the port the first one holds
    with reserved_port(lambda: next(probes)) as first:
        with reserved_port(lambda: next(probes)) as second:
            assert (first, second) == (40001, 40002)
    with reserved_port(lambda: 40001) as again:  # released on exit
        assert again == 40001


def test_run_recipe_refuses_a_run_without_its_own_directory(tmp_path):
    check_output_dir(["cp=2"], tmp_path)
    check_output_dir(["cp=2", f"hydra.run.dir={tmp_path}"], None)
    check_output_dir(["-m", "cp=1,2", f"hydra.sweep.dir={tmp_path}"], None)
    with pytest.raises(ValueError, match="pass run_dir"):
        check_output_dir(["cp=2"], None)
    with pytest.raises(ValueError, match="pass a hydra.sweep.dir= argument"):
        check_output_dir(["-m", "cp=1,2"], tmp_path)  # hydra.run.dir does not place a sweep


def _texts(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_every_recipe_command_built_in_the_tests_names_its_output_dir():
    """A command list that names a recipe script directly (not through run_recipe, which checks it at run time)
    also passes hydra.run.dir= or hydra.sweep.dir=."""
    missing = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.List):
                continue
            texts = _texts(node)
            if any(t.startswith("recipes/") and t.endswith(".py") for t in texts) and not any(
                    "hydra.run.dir=" in t or "hydra.sweep.dir=" in t for t in texts):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, f"recipe commands without hydra.run.dir / hydra.sweep.dir: {missing}"
