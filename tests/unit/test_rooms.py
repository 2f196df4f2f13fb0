"""The shared library as rooms (issue 35; docs/design.md, *Where each concern lives*):
specdecode/ keeps its core types at the top and the rest in packages named for the question
each answers; the rooms import in one direction (MAY_IMPORT), and no module reaches into
another room's private names. Every import counts, a function's own and a type checker's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.imports import imports
from tests.support.paths import ROOT

LIBRARY = ROOT / "specdecode"
GENERATED = "v1"  # protoc's output: where the proto package puts it, not a room
# What each part of specdecode/ may import of the rest ("core": the modules at the top).
MAY_IMPORT = {
    "core": {"grammar"},  # the data model checks a request's grammar spec
    "grammar": {"core"},
    "executor": {"core", "grammar"},  # where a forward runs
    "models": {"core", "grammar", "executor"},  # where a model comes from: loads a runner
    "wire": {"core", "grammar", GENERATED},  # what travels: dataclasses <-> protobuf
    "telemetry": set(),  # what the process tells about itself
    "serving": {"core", "grammar", GENERATED, "executor", "wire", "telemetry"},
    "api": {"core", "grammar", GENERATED, "serving"},  # the client SDK: a token, TLS
}
# Libraries a room must not import: the executor runs forwards and neither serves (gRPC),
# nor exports (Prometheus, the OpenTelemetry SDK; the API's current span is fine), nor
# decodes messages; the wire and the models room serve nothing either.
NOT_IMPORTED = {
    "executor": ("grpc", "prometheus_client", "opentelemetry.sdk", "google.protobuf"),
    "wire": ("grpc", "prometheus_client", "opentelemetry"),
    "models": ("grpc", "prometheus_client", "opentelemetry"),
}
# Code outside specdecode/ that must not reach into a room's private names either.
OUTSIDE = ("orchestrator", "proposer_svc", "scorer_svc", "specdecode_stack", "bench", "tests")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def part_of(module: str) -> str | None:
    """The room (package) of specdecode/ that holds `module`, "core" for a module at the top,
    None outside specdecode/. A unit test belongs to the room it mirrors."""
    parts = module.split(".")
    if parts[:3] == ["tests", "unit", "specdecode"]:
        parts = parts[2:]
    if parts[0] != "specdecode" or len(parts) == 1:
        return None
    return parts[1] if (LIBRARY / parts[1]).is_dir() else "core"


def library() -> dict[str, Path]:
    return {module_name(p): p for p in LIBRARY.rglob("*.py")
            if p.relative_to(LIBRARY).parts[0] != GENERATED}


def test_at_most_15_modules_at_the_top_and_two_or_more_in_every_room():
    top = [p.name for p in LIBRARY.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 15, f"specdecode/ holds {len(top)} modules: move some into a room ({top})"
    small = {str(d.relative_to(ROOT)): n for d in LIBRARY.rglob("*") if d.is_dir()
             and d.name != "__pycache__"
             and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) < 2}
    assert not small, f"a room holds two modules or more: {small}"


def test_every_room_is_drawn():
    rooms = {d.name for d in LIBRARY.iterdir() if (d / "__init__.py").exists()} - {GENERATED}
    assert rooms == set(MAY_IMPORT) - {"core"}


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_a_room_imports_only_what_it_may(room):
    found = sorted(f"{m} imports {i}" for m, path in library().items() if part_of(m) == room
                   for i in imports(path) if part_of(i) not in (None, room, *MAY_IMPORT[room]))
    assert found == [], f"{room} may import only {sorted(MAY_IMPORT[room])}"


@pytest.mark.parametrize("room", sorted(NOT_IMPORTED))
def test_a_room_imports_no_library_beyond_its_question(room):
    banned = NOT_IMPORTED[room]
    found = sorted(f"{m} imports {i}" for m, path in library().items() if part_of(m) == room
                   for i in imports(path) if any(i == b or i.startswith(b + ".") for b in banned))
    assert found == []


def private_uses(path: Path, modules: set[str]) -> set[tuple[str, str]]:
    """(module, name) of every private name of the shared library that `path` imports or
    reads as an attribute of an imported module (`from specdecode.x import _y`, `x._y`)."""
    tree, bound, found = ast.parse(path.read_text()), {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif node.module in modules:
                    found.add((node.module, alias.name))
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound:
            found.add((bound[node.value.id], node.attr))
    return {(m, n) for m, n in found if n.startswith("_") and not n.startswith("__")}


def test_no_module_reaches_into_another_rooms_private_names():
    modules = set(library())
    paths = [*LIBRARY.rglob("*.py"), *(p for d in OUTSIDE for p in (ROOT / d).rglob("*.py"))]
    found = sorted(f"{module_name(p)} uses {m}.{n}" for p in paths
                   if p.relative_to(LIBRARY.parent).parts[:2] != ("specdecode", GENERATED)
                   for m, n in private_uses(p, modules)
                   if part_of(module_name(p)) != part_of(m))
    assert found == []


def test_the_unit_tests_mirror_the_rooms():
    rooms = {d.name for d in LIBRARY.iterdir() if (d / "__init__.py").exists()}
    folders = {d.name for d in (ROOT / "tests" / "unit" / "specdecode").iterdir()
               if d.is_dir() and d.name != "__pycache__"}
    assert folders <= rooms, f"tests/unit/specdecode/ folders that name no room: {folders - rooms}"
