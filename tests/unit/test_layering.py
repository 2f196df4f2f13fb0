"""The house's structure (issue 19, docs/design.md *Layout*): the orchestrator's three rooms
import as drawn, the client side imports no server room, and no module import cycle exists."""

from __future__ import annotations

from pathlib import Path

from tests.support.imports import imports
from tests.support.paths import ROOT

PACKAGES = ("orchestrator", "specdecode", "proposer_svc", "scorer_svc", "specdecode_stack")
ROOMS = ("orchestrator.engine", "orchestrator.cluster", "orchestrator.frontend")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(sources, forbidden) -> list[str]:
    return sorted(f"{m} imports {i}" for m, path in modules().items() if within(m, sources)
                  for i in imports(path) if within(i, forbidden))


def test_the_rooms_import_as_drawn():
    # The engine is the core: it reaches the services through specdecode.interfaces only.
    assert violations(["orchestrator.engine"], ["orchestrator.cluster",
                                                "orchestrator.frontend"]) == []
    assert violations(["orchestrator.cluster"], ["orchestrator.frontend"]) == []
    assert violations(["orchestrator.frontend"], ["orchestrator.cluster"]) == []
    # The shared library and the services know nothing of the orchestrator.
    assert violations(["specdecode", "proposer_svc", "scorer_svc"],
                      ["orchestrator", "specdecode_stack"]) == []


def test_the_client_side_imports_no_server_room():
    assert violations(["specdecode.api", "specdecode_stack.cli"], ROOMS) == []


def test_no_import_cycle():
    """Among the imports that run at import time (a function's own import is a deliberate
    late binding, e.g. the entry points'), the module graph is acyclic."""
    mods = modules()
    graph = {m: {i for i in imports(p, top_level_only=True) if i in mods and i != m}
             for m, p in mods.items()}
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (cycle := visit(n, path + [m])):
                return cycle
        state[m] = 2
        return None

    cycles = [cycle for m in sorted(graph) if m not in state and (cycle := visit(m, []))]
    assert cycles == []
