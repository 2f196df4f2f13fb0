"""A soak: steady mixed load with faults, through real processes (issue 33).

    python bench/soak.py [--model smollm2|tiny] [--duration 600] [--concurrency 8]
                         [--write-timeout 30] [--restart-at 0.4] [--seed 0] [--out FILE]

`concurrency` clients loop until `duration` seconds have passed, each request drawn at
random: 5% a streamed HTTP completion whose socket is never read (closed by the server at
the stream write timeout), 10% a gRPC stream cancelled by its client after a few messages,
the rest gRPC streams to completion, half greedy and half sampled (seeded), 32-192 tokens.
The scorer is restarted once (SIGTERM, then started again on its address) at `restart-at`
of the duration; the orchestrator holds its streams meanwhile (--scorer-retry-timeout).
Reports, as JSON: requests by kind and outcome, errors (any failure that is not the
client's own cancel), the resident memory (RSS, MiB) of every process at 1 minute (or at
the end of a shorter run) and at the end, and the sequences held once the load is gone
(running on the orchestrator; KV entries on the proposer and scorer).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import click
import grpc
import psutil

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig, free_port

TEXT = "Tell me about the sea, the ships and the harbours of the north."
IDS = [5, 17, 99, 3, 42]


@dataclasses.dataclass
class Tally:
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind}:{outcome}"] += 1
            if error:
                self.errors.append(f"{kind}: {error}")


def one_request(rng: random.Random, address: str, http_port: int, prompt, tally: Tally,
                stalled: list) -> None:
    draw, max_tokens = rng.random(), rng.randint(32, 192)
    if draw < 0.05:
        body = json.dumps({"prompt": prompt, "max_tokens": 6000, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", http_port))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        stalled.append(sock)  # never read; closed at the end
        tally.add("never_read", "sent")
        return
    params = ({"temperature": 0.0} if rng.random() < 0.5 else
              {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 30)})
    kind = "cancelled" if draw < 0.15 else ("greedy" if params["temperature"] == 0 else "sampled")
    try:
        with SpecDecodeClient(address) as client:
            call = client.stream(prompt, max_tokens=max_tokens, **params)
            for i, response in enumerate(call):
                if kind == "cancelled" and i >= 2:
                    call.cancel()
                    break
        tally.add(kind, "cancelled" if kind == "cancelled" else "ok")
    except grpc.RpcError as exc:
        if kind == "cancelled" and exc.code() == grpc.StatusCode.CANCELLED:
            tally.add(kind, "cancelled")
        else:
            tally.add(kind, "error", f"{exc.code().name}: {exc.details()}")


def rss(stack: LocalStack) -> dict[str, float]:
    return {role: psutil.Process(p.pid).memory_info().rss / 2**20
            for role, p in stack.processes.items()}


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def held(stack: LocalStack) -> dict[str, float]:
    out = {"orchestrator_running": metric(stack.metrics_ports["orchestrator"],
                                          "specdecode_running_sequences")}
    for role in ("proposer", "scorer"):
        out[f"{role}_kv_sequences"] = metric(stack.metrics_ports[role],
                                             "specdecode_kv_cache_sequences")
    return out


def soak(stack: LocalStack, http_port: int, prompt, duration: float, concurrency: int,
         write_timeout: float, restart_at: float, seed: int) -> dict:
    tally, stalled, memory = Tally(), [], {}
    start = time.monotonic()
    end = start + duration

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < end:
            one_request(rng, stack.address, http_port, prompt, tally, stalled)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    restart_s = 0.0

    def restart() -> None:
        nonlocal restart_s
        began = time.monotonic()
        stack.restart("scorer")
        restart_s = time.monotonic() - began

    def sample() -> None:
        memory["rss_mib_at_1min"] = rss(stack)
    for at, event in sorted([(restart_at * duration, restart),
                             (min(60.0, duration) - 1, sample)], key=lambda e: e[0]):
        time.sleep(max(0.0, start + at - time.monotonic()))
        event()
    for t in threads:
        t.join()
    # never-read streams fill their buffers, pause, and are cancelled a write timeout later
    deadline = time.monotonic() + 300 + write_timeout
    while held(stack)["orchestrator_running"] and time.monotonic() < deadline:
        time.sleep(1)
    memory["rss_mib_at_end"] = rss(stack)
    after = held(stack)
    for sock in stalled:
        sock.close()
    return {"requests": dict(tally.outcomes), "total": sum(tally.outcomes.values()),
            "errors": len(tally.errors), "error_samples": tally.errors[:5],
            "scorer_restart_s": restart_s, **memory, "held_after": after,
            "write_timeouts": metric(stack.metrics_ports["orchestrator"],
                                     "specdecode_stream_write_timeouts_total")}


@click.command()
@click.option("--model", type=click.Choice(["smollm2", "tiny"]), default="smollm2")
@click.option("--duration", default=600.0)
@click.option("--concurrency", default=8)
@click.option("--write-timeout", default=30.0)
@click.option("--restart-at", default=0.4)
@click.option("--seed", default=0)
@click.option("--out", default=None)
def main(model, duration, concurrency, write_timeout, restart_at, seed, out):
    root = Path(tempfile.mkdtemp(prefix="soak_"))
    kw = {}
    if model == "tiny":
        from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
        for name, spec in (("target", TinyModelSpec(seed=1, max_position_embeddings=8192)),
                           ("draft", TinyModelSpec(seed=2, num_layers=1,
                                                   max_position_embeddings=8192))):
            build_tiny_model(spec).save_pretrained(root / name)
        kw = {"target_model": str(root / "target"), "draft_model": str(root / "draft"),
              "tokenizer": "none"}
    http_port = free_port()
    config = StackConfig(http_port=http_port, log_file=str(root / "stack.log"),
                         orchestrator_args=["--stream-write-timeout", str(write_timeout)], **kw)
    with LocalStack(config) as stack:
        result = {"model": model, "duration_s": duration, "concurrency": concurrency,
                  **soak(stack, http_port, IDS if model == "tiny" else TEXT, duration,
                         concurrency, write_timeout, restart_at, seed)}
    result["log"] = str(root / "stack.log")
    print(json.dumps(result, indent=2))
    if out:
        Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
