"""The tests' own layout: unit tests (tests/unit/, mirroring the packages) run in-process;
anything that starts a process or a server on a socket is an integration test
(tests/integration/); the chart checks are their own kind (tests/chart/); helpers live in
tests/support/, fixtures in conftest.py files."""

from __future__ import annotations

from tests.support.imports import imports
from tests.support.paths import ROOT

TESTS = ROOT / "tests"
KINDS = ("unit", "integration", "chart")
# What only a test that starts processes or servers needs.
PROCESS_MODULES = ("subprocess", "multiprocessing", "tests.support.cluster")
PROCESS_NAMES = {"LocalStack", "free_port", "wait_process_serving"}


def test_every_test_file_sits_under_its_kind():
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.relative_to(TESTS).parts[0] not in KINDS]
    assert not misplaced, f"put these under tests/unit/ or tests/integration/: {misplaced}"


def test_unit_tests_start_no_processes_or_servers():
    offenders = {}
    for path in (TESTS / "unit").rglob("*.py"):
        found = {m for m in imports(path) if m.startswith(PROCESS_MODULES)
                 or m.rsplit(".", 1)[-1] in PROCESS_NAMES}
        if found:
            offenders[str(path.relative_to(TESTS))] = sorted(found)
    assert not offenders, f"these start processes or servers: tests/integration/ ({offenders})"


def test_helpers_come_from_tests_support_not_from_a_conftest():
    users = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
             if any(m.startswith("tests.conftest") or m.endswith(".conftest") for m in imports(p))]
    assert not users, f"import helpers from tests.support: {users}"
