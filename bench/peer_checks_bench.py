"""What the scorer's peer checks cost per step (docs/design.md, "Services check their peers"):
decoding a ScoreProposals request (request and proposals off the wire) against the checks
that follow it (ExecuteModelRequest.validate, SpeculativeProposals.validate), side by side.

    python bench/peer_checks_bench.py [--shapes 1x8,8x8] [--vocab 49152] [--context 512]

Each shape BxK runs greedy (no draft probabilities on the wire) and sampled (probabilities
[B, k, V], sent sparse under top-k 50 as a draft model sends them, and dense).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.wire import codec
from specdecode.interfaces import SpeculativeProposals
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.v1 import scorer_service_pb2


def message(B: int, k: int, V: int, context: int, probs: str) -> scorer_service_pb2.ScoreProposalsRequest:
    """A step of B sequences of `context` tokens with k proposals each; probs: none, sparse
    (top-50 rows) or dense."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams() if probs == "none" else SamplingParams(temperature=0.8, top_k=50)
    req = ExecuteModelRequest([SequenceGroupMetadata(
        f"r{i}", False, {i: SequenceData(torch.randint(0, V, (context,), generator=g).tolist(),
                                         [1])}, params) for i in range(B)], k)
    p = None
    if probs != "none":
        p = torch.softmax(torch.randn(B, k, V, generator=g), -1)
        if probs == "sparse":
            kept = p.topk(50, -1)
            p = torch.zeros_like(p).scatter(-1, kept.indices, kept.values)
            p /= p.sum(-1, keepdim=True)
    proposals = SpeculativeProposals(torch.randint(0, V, (B, k), generator=g), p,
                                     torch.full((B,), k))
    return scorer_service_pb2.ScoreProposalsRequest(
        request=codec.request_to_proto(req), proposals=codec.proposals_to_proto(proposals))


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def measure(B: int, k: int, V: int, context: int, probs: str, repeats: int) -> dict:
    m = message(B, k, V, context, probs)

    def decode():
        req = codec.request_from_proto(m.request)
        return req, codec.proposals_from_proto(m.proposals, batch_size=B, vocab_size=V)
    req, proposals = decode()

    def checks():
        req.validate(V, context + k + 2)
        proposals.validate(req, V, context + k + 2)
    return {"B": B, "k": k, "V": V, "context": context, "probs": probs,
            "bytes": m.ByteSize(), "decode_ms": median_ms(decode, repeats),
            "checks_ms": median_ms(checks, repeats)}


@click.command()
@click.option("--shapes", default="1x8,8x8", show_default=True, help="BxK,...")
@click.option("--vocab", default=49152, show_default=True)
@click.option("--context", default=512, show_default=True, help="tokens per sequence")
@click.option("--repeats", default=30, show_default=True)
@click.option("--out", default="bench/results/peer_checks.json", show_default=True)
def main(shapes: str, vocab: int, context: int, repeats: int, out: str) -> None:
    rows = [measure(*map(int, s.split("x")), vocab, context, probs, repeats)
            for s in shapes.split(",") for probs in ("none", "sparse", "dense")]
    table = Table(title=f"scorer: decoding a step vs checking it, V={vocab}, {context}-token "
                        f"sequences, median of {repeats}")
    for col in ("B x k", "draft probs", "request bytes", "decode ms", "checks ms", "checks/decode"):
        table.add_column(col)
    for r in rows:
        table.add_row(f"{r['B']} x {r['k']}", r["probs"], str(r["bytes"]), f"{r['decode_ms']:.3f}",
                      f"{r['checks_ms']:.3f}", f"{r['checks_ms'] / r['decode_ms']:.2f}")
    Console(width=120).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
