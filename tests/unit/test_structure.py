"""The package's seams hold: the model sees CP only through its protocol, the compatible API is an edge nothing in
the core imports, and no two modules of ``dsv4`` import each other (directly or through a chain), counting imports
inside functions too."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from dsv4.model.context_parallel import ContextParallel
from dsv4.parallel.cp import CPContext
from dsv4.plan.stand_ins import PlanCP

PACKAGE = Path(__file__).resolve().parents[2] / "dsv4"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``dsv4`` modules ``name`` imports anywhere in its file (a package's name for ``from pkg import obj``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_the_package():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_model_code_names_no_cp_package():
    """What ``grep -rn "dsv4.cp" dsv4/model`` checks: not an import, not a docstring reference."""
    for path in (PACKAGE / "model").rglob("*.py"):
        assert not re.search(r"dsv4.cp", path.read_text()), path


def test_the_core_does_not_import_the_compatible_api():
    graph = _graph()
    for name, targets in graph.items():
        if name == "dsv4.cp" or name.startswith("dsv4.cp."):
            continue
        assert not {t for t in targets if t == "dsv4.cp" or t.startswith("dsv4.cp.")}, name


def _protocol_members() -> dict[str, object]:
    members = {}
    for klass in reversed(ContextParallel.__mro__):
        members.update({k: v for k, v in vars(klass).items() if not k.startswith("_")})
    members.update({k: None for k in ContextParallel.__annotations__})
    return members


def test_the_cp_runtime_and_the_plan_stand_in_implement_the_model_protocol():
    for cp in (CPContext(None, balance="full"), PlanCP(rank=1, size=2, balance="full")):
        assert isinstance(cp, ContextParallel), type(cp)
        for name, member in _protocol_members().items():
            assert hasattr(cp, name), (type(cp).__name__, name)
            if inspect.isfunction(member):
                wanted = list(inspect.signature(member).parameters)[1:]
                got = list(inspect.signature(getattr(cp, name)).parameters)
                assert got[: len(wanted)] == wanted, (type(cp).__name__, name, got, wanted)
    planned = PlanCP(rank=1, size=2, balance="full")
    assert (planned.chunks_per_rank, planned.num_chunks, planned.local_rows(1)) == (2, 4, [(0, 1), (0, 2)])
