"""Measured forward costs (specdecode/cost_model.py): interpolation, monotony, the verify
cost by scoring method, calibration, and the table on the wire."""

from __future__ import annotations

import pytest

from specdecode.cost_model import ForwardCosts, cheaper_scoring, verify_seconds
from specdecode.executor.calibration import calibrate
from specdecode.errors import InvalidRequestError
from specdecode.model_info import ModelInfo
from specdecode.executor.model_runner import ModelRunner
from specdecode.wire.codec import model_info_from_proto, model_info_to_proto
from tests.support.adaptive import ROWS, TOKENS, table
from tests.support.models import CPU


def test_forward_costs_interpolate_extrapolate_and_stay_monotone_across_rows():
    costs = table(1.0, 0.5)
    assert costs(1, 1) == pytest.approx(1.0)
    assert costs(1, 4) == pytest.approx(2.5)  # between the 3- and 5-token points
    assert costs(1, 13) == pytest.approx(7.0)  # linear beyond the last token point
    # Beyond the last row point: that row count with as many tokens in all (8 x 1 = 4 x 2),
    # linear in them past the widest cell (8 x 9 = 4 x 18: twice the 9-token forward).
    assert costs(8, 1) == pytest.approx(costs(4, 2)) == pytest.approx(1.5)
    assert costs(8, 9) == pytest.approx(2 * costs(4, 9)) == pytest.approx(10.0)
    flat = table(0.3, 0.0, tokens=[1, 2, 3, 4, 5])  # bf16 at 4 rows: flat up to 5 tokens ...
    flat.seconds[-1][-1] = 0.6  # ... then the knee (the Qwen target measured 0.31 -> 0.63 s)
    assert flat(10, 2) == pytest.approx(0.6) and flat(10, 1) < 0.35  # 20 tokens: the knee
    # fp32 on CPU: a 2-token forward measured faster than a decode is kept as measured (no
    # envelope across widths: it lifted every wider verify to the slowest narrower one) ...
    fp32 = ForwardCosts([1, 4], [1, 2, 3], [[1.0, 0.4, 2.0], [0.9, 1.0, 2.5]])
    assert fp32(1, 2) == pytest.approx(0.4)
    assert fp32(4, 1) == pytest.approx(1.0)  # ... but more rows never cost less
    assert fp32.observe(1, 3, 4.0) and fp32(1, 3) == pytest.approx(2.4)  # EWMA 0.2
    assert not fp32.observe(1, 4, 9.9)  # not a grid point: ignored
    with pytest.raises(ValueError, match="2x5"):
        ForwardCosts(ROWS, TOKENS, [[1.0] * 5])


def test_verify_cost_by_scoring_method():
    costs = table(1.0, 0.1, per_row=0.2)
    lens = [4, 0, 2]
    # multi-query feeds each row its own tokens (5 + 1 + 3, packed): 3 rows at their mean width
    assert verify_seconds(costs, "multi-query", lens) == costs(3, 3)
    assert verify_seconds(costs, "batch-expansion", lens) == costs(5 + 1 + 3, 5)
    # Expanded rows are padded to the same width, so batch expansion never costs less in
    # this runner; auto scoring therefore picks multi-query whenever costs are monotone.
    assert cheaper_scoring(costs, lens) == "multi-query"
    assert cheaper_scoring(costs, [0, 0]) == "multi-query"


def test_calibrate_times_every_cell_and_leaves_no_cache(target_model):
    runner = ModelRunner(target_model, CPU)
    seen = []
    runner.on_forward = seen.append
    costs = calibrate(runner, rows=(1, 2), tokens=(1, 3), repeats=1, context=8)
    assert costs.rows == [1, 2] and costs.tokens == [1, 3]
    assert all(s > 0 for line in costs.seconds for s in line)
    assert runner.num_cached_sequences == 0 and not seen  # not traffic: no hook, no counters
    assert runner.stats.forward_calls == 0 and runner.stats.tokens_computed == 0


def test_model_info_carries_forward_costs_over_the_wire():
    info = ModelInfo("m", 256, "fp", 128, role="scorer", scoring_method="auto",
                     forward_cost=table(0.3, 0.1))
    back = model_info_from_proto(model_info_to_proto(info))
    assert back.forward_cost.seconds == info.forward_cost.seconds
    assert back.scoring_method == "auto"
    assert model_info_from_proto(model_info_to_proto(ModelInfo("ngram", 0, "", 9))).forward_cost is None
    bad = model_info_to_proto(info)
    del bad.forward_cost.seconds[-1]
    with pytest.raises(InvalidRequestError, match="forward_cost"):
        model_info_from_proto(bad)
