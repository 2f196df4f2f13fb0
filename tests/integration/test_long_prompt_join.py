"""Chunked prefill through the stack: a 4,000-token prompt joins beside a running stream
without stalling it, and both outputs stay the target's."""

from __future__ import annotations

import re
import statistics
import urllib.request

import torch

from bench.harness import BEFORE, stream_with_join
from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig
from tests.support.references import reference_greedy

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
