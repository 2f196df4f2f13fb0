"""Chunked prefill: a long prompt is computed across steps within the per-step token
budget, so streams already running keep their pace, and every output stays the target's."""

from __future__ import annotations

import dataclasses
import re
import statistics
import urllib.request

import pytest
import torch

from bench.join_stream import BEFORE, stream_with_join
from bench.tiny_models import build_tiny_model
from specdecode.api.client import SpecDecodeClient
from orchestrator.engine.request import Sequence
from orchestrator.engine.scheduler import plan_step
from orchestrator.engine.prefill_pacing import MIN_CHUNK, PrefillPacer
from specdecode_stack.local import LocalStack, StackConfig
from tests.conftest import DRAFT, TARGET, greedy_request, make_engine, reference_greedy

LONG_CONTEXT = 8192


def _seq(i: int, prompt_len: int, output: int = 0, prefilled: int = 0) -> Sequence:
    s = Sequence(i, greedy_request(str(i), [1] * prompt_len, 8))
    s.output_token_ids, s.prefilled = [2] * output, prefilled
    return s


def test_plan_gives_running_streams_their_tokens_and_prompts_the_rest():
    k_of = lambda s: 3  # noqa: E731
    running, long, short = _seq(0, 10, output=5), _seq(1, 1000), _seq(2, 20)
    # 1 running (k+1 = 4 tokens), then the long prompt's first chunk takes the other 252.
    assert [(s.seq_id, c) for s, c in plan_step([running, long, short], k_of, 256)] == \
        [(0, None), (1, 252)]
    long.prefilled = 252 * 3
    # Its last 244 tokens fit: it joins whole; the short prompt waits for the next step
    # (only 8 tokens are left, under the smallest chunk).
    assert [(s.seq_id, c) for s, c in plan_step([running, long, short], k_of, 256)] == \
        [(0, None), (1, None)]
    # Decoding never waits, even past the budget; the first prompt still gets a quarter.
    busy = [_seq(i, 10, output=5) for i in range(100)]
    plan = plan_step([*busy, long], k_of, 256)
    assert len(plan) == 101 and plan[-1] == (long, 252 * 3 + 64)
    assert plan_step([running, long], k_of, None) == [(running, None), (long, None)]
    # Paced (beside decoders only): the prompt gets the pace, however much budget is left.
    long.prefilled = 0
    assert plan_step([running, long], k_of, 256, paced=32) == [(running, None), (long, 32)]
    assert plan_step([long], k_of, 256, paced=32) == [(long, 256)]


def test_pacer_aims_a_prompt_step_at_twice_a_decode_step():
    pacer = PrefillPacer()
    assert pacer.cap() is None  # nothing to pace against yet
    for _ in range(5):
        pacer.observe(0.010, 0, decoding=1)  # decode steps: 10 ms
    assert pacer.cap() == 4 * MIN_CHUNK
    pacer.observe(0.050, 4 * MIN_CHUNK, decoding=1)  # 5x a decode step: shrinks, by half
    pacer.observe(0.015, 2 * MIN_CHUNK, decoding=1)  # cheap: grows (at most 2x a step)
    assert pacer.cap() == 4 * MIN_CHUNK
    pacer.observe(0.012, 5, decoding=1)  # a short prompt did not use the pace: kept
    assert pacer.cap() == 4 * MIN_CHUNK
    pacer.observe(0.040, 4 * MIN_CHUNK, decoding=1)  # 4x a decode step: shrinks, by half
    assert pacer.cap() == 2 * MIN_CHUNK
    pacer.observe(0.020, 2 * MIN_CHUNK, decoding=1)  # right on target: kept
    assert pacer.cap() == 2 * MIN_CHUNK
    pacer.observe(1.0, 2 * MIN_CHUNK, decoding=1)  # a stall never takes it below MIN_CHUNK
    pacer.observe(1.0, MIN_CHUNK, decoding=1)
    assert pacer.cap() == MIN_CHUNK
    pacer.observe(0.5, 4000, decoding=0)  # no decoder waited: nothing learned
    assert pacer.cap() == MIN_CHUNK and pacer.decode_step_s == pytest.approx(0.010)


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    target = build_tiny_model(dataclasses.replace(TARGET, max_position_embeddings=LONG_CONTEXT))
    draft = build_tiny_model(dataclasses.replace(DRAFT, max_position_embeddings=LONG_CONTEXT))
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return target, draft, {"target": str(root / "target"), "draft": str(root / "draft")}


@pytest.mark.parametrize("scoring", ["batch-expansion", "multi-query"])
def test_chunked_output_equals_target_in_process(long_models, scoring):
    target, draft, _ = long_models
    long = torch.randint(0, 256, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    short = [5, 17, 99, 3]
    engine = make_engine(target, draft, scoring, 3)
    engine.max_num_batched_tokens = 128
    done = engine.generate([greedy_request("a", short, 20), greedy_request("b", long, 8)])
    assert done["a"].output_token_ids == reference_greedy(target, short, 20)
    assert done["b"].output_token_ids == reference_greedy(target, long, 8)
    assert engine.steps > 1500 // 128  # the long prompt really went in chunks


STALL_BOUND = 5  # largest gap / median gap: above the 4x a 1,024-token forward may cost,
#                 below the ~10x of an unchunked prompt (see the test's docstring)


def test_long_prompt_joins_without_stalling_a_running_stream(long_models):
    """A 4,000-token prompt joins beside a running stream (budget 256 tokens per step):
    the running stream's largest gap stays under 5x its median, both outputs are exact.

    The stream is measured from 30 tokens before the join until 10 tokens after the long
    request finished (then it is cancelled), so its median covers the join and the stream
    alone. The median gap is a step with a ~256-token chunk; a forward may compute up to
    4x that (the structural bound below: 1,024 tokens), so a largest gap of ~3-4x the median
    is by design (measured on a quiet 2-core machine, attempts after the first: 1.9-3.6x;
    the bound used to be 3x and failed CI 1 run in 2). Noise: a decode step of the tiny
    models is ~3 ms, about one scheduler time slice, so other processes alone can stretch one
    gap further. A stall from the prefill (an unchunked prompt: ~10x; the ~1.05 s proposer
    timeout a chunk used to hit under load: ~300x) is systematic and shows in every attempt,
    the machine's noise does not: the join is tried up to 5 times, each with a new prompt, and
    the bound must hold in one; exact outputs and the forward-size bound hold in all."""
    target, _, dirs = long_models
    short = [5, 17, 99, 3]
    n_long = 8
    config = StackConfig(target_model=dirs["target"], draft_model=dirs["draft"],
                         tokenizer="none", device="cpu", num_speculative_tokens=3, port=0,
                         orchestrator_args=["--max-num-batched-tokens", "256"])
    ratios, streamed = [], []
    with LocalStack(config) as stack, SpecDecodeClient(stack.address) as client:
        client.generate(short, max_tokens=4)  # warm up both services
        for attempt in range(5):
            long = torch.randint(0, 256, (4000,),
                                 generator=torch.Generator().manual_seed(attempt)).tolist()
            joined = stream_with_join(client, short, long, n_long, stream_max_tokens=2000)
            assert joined.times[-1] > joined.end, "the stream ended first"
            streamed.append(joined.tokens)
            assert joined.long_tokens == reference_greedy(target, long, n_long)
            gaps = joined.window
            alone = statistics.median(gaps[:BEFORE - 1])
            median, worst = statistics.median(gaps), max(gaps)
            ratios.append(worst / median)
            print(f"attempt {attempt}: the running stream's median gap {median * 1e3:.1f} ms "
                  f"({alone * 1e3:.1f} ms alone), largest {worst * 1e3:.1f} ms "
                  f"({ratios[-1]:.2f}x the median, {worst / alone:.2f}x alone); the long "
                  f"prompt took {joined.seconds:.2f} s")
            if ratios[-1] < STALL_BOUND:
                break
        largest = {role: largest_forward(stack, role) for role in ("proposer", "scorer")}
    # The structural property, free of timing noise: no forward pass on either service
    # computed more than ~the step budget (without chunks the scorer's first forward of the
    # long prompt computes 4,000 tokens, the draft's the same on its first decode step).
    assert max(largest.values()) <= 1024, largest
    expected = reference_greedy(target, short, max(map(len, streamed)))
    assert all(tokens == expected[:len(tokens)] for tokens in streamed)
    assert min(ratios) < STALL_BOUND, ratios


def largest_forward(stack: LocalStack, role: str) -> float:
    """Upper bound of the bucket of the largest forward pass (new tokens) a service ran."""
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{stack.metrics_ports[role]}/metrics").read().decode()
    buckets = []  # (le, cumulative count)
    for line in body.splitlines():
        if line.startswith("specdecode_model_forward_tokens_bucket{") and f'role="{role}"' in line:
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = max(n for _, n in buckets)
    return min(le for le, n in buckets if n == total)
