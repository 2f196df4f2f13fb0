"""The wire contract in protos/: generated code is current, and `buf lint` (STANDARD
rules, see buf.yaml) and `buf format` pass."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

GENERATED = ROOT / "specdecode" / "v1"
BUF = Path(os.environ.get("BUF", ROOT / ".cache" / "tools" / "node_modules" / ".bin" / "buf"))

sys.path.insert(0, str(ROOT / "scripts"))
import gen_protos  # noqa: E402

sys.path.pop(0)


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=tmp_path)
    fresh = [p.name for p in gen_protos.generated_files(tmp_path)]
    committed = [p.name for p in gen_protos.generated_files(ROOT)]
    hint = "specdecode/v1 is stale: run `python scripts/gen_protos.py` and commit the result"
    assert fresh == committed, hint
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "specdecode" / "v1", GENERATED, fresh,
                                           shallow=False)
    assert not mismatch and not errors, f"{hint} (differs: {mismatch + errors})"


def _buf(*args: str) -> subprocess.CompletedProcess[str]:
    if not BUF.exists():
        pytest.fail(f"buf not found at {BUF}: run scripts/install-buf.sh (or set BUF=/path/to/buf)")
    return subprocess.run([str(BUF), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_buf_lint_passes() -> None:
    r = _buf("lint")
    assert r.returncode == 0, f"buf lint failed:\n{r.stdout}{r.stderr}"


def test_buf_format_is_clean() -> None:
    r = _buf("format", "--diff", "--exit-code")
    assert r.returncode == 0, f"run `buf format -w`:\n{r.stdout}{r.stderr}"
