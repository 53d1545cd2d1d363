"""README.md, docs/ and benchmarks/README.md agree with the repository: the README is the short front door (under
15,000 characters, an architecture table of 5-15 real modules, the test command CI runs), every link resolves,
every config group / option and repository path they name exists, and no page narrates history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
DOC_PATHS = sorted((REPO / "docs").glob("*.md")) + [REPO / "benchmarks" / "README.md"]
PAGES = {path.relative_to(REPO).as_posix(): path.read_text() for path in [REPO / "README.md", *DOC_PATHS]}
CONF = REPO / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


# Sentences that narrate the code's past instead of stating what it does (git keeps the history).
HISTORY_PATTERNS = [
    r"\bhistory\b",
    r"\bthe issue\b",
    r"\bwas filed\b",
    r"\b(?:before|after) (?:this|the) change\b",
    r"\ban earlier (?:run|session|version)\b",
    r"\bearlier session\b",
    r"\bthis session\b",
    r"\bprevious (?:run|session|version|kernel|code|implementation)\b",
    r"\bpreviously\b",
    r"(?<!is )(?<!are )(?<!be )\bused to\b",
    r"\bno longer\b",
    r"\bformerly\b",
    r"\bthe former\b",
    r"\bre-?measured\b",
    r"\bnow\b",
    r"\b(?:at|commit) (?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
]

PATH_ROOTS = r"(?:dsv4|benchmarks|tests|recipes|conf|docs|\.ci)"


def _exists(path: str) -> bool:
    target = REPO / path
    return target.is_dir() if path.endswith("/") else target.exists()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", _without_code_blocks(text), re.M)}


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_readme_is_the_short_front_door():
    assert len(README) < 15_000, len(README)


def test_architecture_table_lists_5_to_15_real_modules():
    section = README.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    modules = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert 5 <= len(modules) <= 15, modules
    for path in modules:
        assert (REPO / path).is_file(), path


def test_readme_test_command_is_what_ci_runs():
    command = "pip install -e '.[test]' && pip install --no-deps nemo-automodel==0.7.0 && python -m pytest -q"
    assert command in README and command in (REPO / ".ci" / "run").read_text()
    assert command in (REPO / "docs" / "testing.md").read_text()


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(((?:docs/[\w-]+|benchmarks/README)\.md)(?:#[\w-]*)?\)", README))
    expected = {path.relative_to(REPO).as_posix() for path in DOC_PATHS}
    assert expected <= linked, sorted(expected - linked)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_links_resolve(page):
    base = (REPO / page).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", PAGES[page]):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (base / file).resolve() if file else REPO / page
        assert path.exists(), f"{page}: {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path.read_text()), f"{page}: {target} (no such heading)"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_named_config_groups_and_options_exist(page):
    text = PAGES[page]
    for group in re.findall(r"(?<![\w./])conf/(\w+)/", text):
        assert (CONF / group).is_dir(), f"{page}: conf/{group}/"
    for group, option in re.findall(r"(?<![\w./])conf/(\w+)/(\w+)\.yaml", text):
        assert (CONF / group / f"{option}.yaml").is_file(), f"{page}: conf/{group}/{option}.yaml"
    for name in re.findall(r"(?<![\w./])conf/(\w+)\.yaml", text):
        assert (CONF / f"{name}.yaml").is_file(), f"{page}: conf/{name}.yaml"
    # `group=option` overrides, for the groups conf/ has (hydra/... groups and dotted keys do not match).
    pattern = r"(?<![\w./~+-])(" + "|".join(GROUPS) + r")=(\w+)"
    for group, option in re.findall(pattern, text):
        assert (CONF / group / f"{option}.yaml").is_file(), f"{page}: {group}={option}"


def test_configuration_page_lists_every_group_and_option():
    """docs/configuration.md's listing (`    conf/<group>/  options ...`) names every group and every option."""
    text = PAGES["docs/configuration.md"]
    blocks = dict(re.findall(r"^    conf/(\w+)/ +(.*(?:\n {26,}.*)*)", text, re.M))
    assert sorted(blocks) == GROUPS
    for group, block in blocks.items():
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            assert re.search(rf"\b{option}\b", block), f"conf/{group}/{option}.yaml is not listed"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_named_repository_paths_exist(page):
    text = PAGES[page]
    spans = re.findall(r"`([^`\s]+)`", text)
    paths = [s for s in spans if re.fullmatch(PATH_ROOTS + r"/[\w./-]*", s)]
    paths += re.findall(r"(?<![\w/.-])(" + PATH_ROOTS + r"/[\w/.-]*\.(?:py|yaml|md|sh))(?![\w/-])", text)
    missing = sorted({p for p in paths if not _exists(p)})
    assert not missing, f"{page} names paths that do not exist: {missing}"


def test_benchmark_scripts_named_exist_and_are_all_listed():
    for page, text in PAGES.items():
        for script in re.findall(r"(?<![\w/.-])benchmarks/(\w+)\.py", text):
            assert (REPO / "benchmarks" / f"{script}.py").is_file(), f"{page}: benchmarks/{script}.py"
    table = PAGES["benchmarks/README.md"]
    listed = set(re.findall(r"^\| `benchmarks/(\w+)\.py` \|", table, re.M))
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py")  # scripts, not their helpers (common)
               if 'if __name__ == "__main__":' in p.read_text()}
    assert scripts <= listed, sorted(scripts - listed)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_no_page_narrates_history(page):
    found = [m.group(0) for pattern in HISTORY_PATTERNS for m in re.finditer(pattern, PAGES[page], re.I)]
    assert not found, f"{page}: {found}"
