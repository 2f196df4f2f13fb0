"""`executor_bench.py parts` on the tiny model (seconds): its table's parts add up to no more
than the step they split, the row-invariant runner's (RowTiledLinear) matmuls still reach
their parts, and its JSON holds the bandwidth and the tile sweep measured beside them."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from bench.executor_bench import HEAD, MLP, PARTS, PROJ, SWEEP_TILES, cli


def ms_cells(output: str, label: str) -> list[float]:
    """The ms cells (B=1, B=4) of the table's line for `label`."""
    line = next(line for line in output.splitlines() if re.match(rf"│ {re.escape(label)} +│", line))
    return [float(c) for c in line.split("│")[2:-1:2]]


def test_parts_split_the_step_and_the_result_has_a_bandwidth(tmp_path):
    out = tmp_path / "parts.json"
    r = CliRunner().invoke(cli, ["parts", "--model", "tiny", "--steps", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    parts = [ms_cells(r.output, part) for part in PARTS]
    step = ms_cells(r.output, "step, hooks on (the sum)")
    for b, total in enumerate(step):
        assert 0 < sum(p[b] for p in parts) <= total + 0.02  # cells round to 0.01 ms
    result = json.loads(out.read_text())
    assert result["read_gbps"] > 0 and result["limit_tokens_per_s"] > 0
    assert [row["batch"] for row in result["rows"]] == [1, 4]
    assert all(row["rest_ms"] >= 0 for row in result["rows"])
    # bfloat16 under --deterministic auto: row-invariant, as the services run it
    assert result["row_invariant"] and re.search(r"row-invariant, blocks of [\d/ |]*16 rows",
                                                 result["numerics"])
    assert all(row["parts_ms"][p] > 0 for row in result["rows"] for p in (PROJ, MLP, HEAD))
    sweep = result["tile_sweep"]
    assert [(s["kernel"], s["tile"]) for s in sweep] == [("F.linear", 1)] + [
        ("oneDNN prepacked", t) for t in SWEEP_TILES]
    assert all(s["ms"] > 0 for s in sweep if not s["error"])
    assert "9 rows: ceil(9/T) x ms" in r.output
