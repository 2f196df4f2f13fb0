"""Streaming clients that never read, beside a neighbour that does (issue 33's drill).

    python bench/never_read.py [--model smollm2|tiny] [--clients 16] [--max-tokens 6000]
                               [--write-timeout 30] [--wait 90] [--out FILE.json]

Starts a local stack (SmolLM2-135M with the n-gram proposer, or the tiny random pair with
an 8,192-token context) with the HTTP API, measures a neighbour's latency (a 16-token
completion, one after another) alone, then opens `clients` streamed completions
(`max_tokens`, ignore_eos) on raw sockets that send the request and never call recv (the
kernel's defaults: what a real client that stops reading leaves), and keeps the neighbour
going for `wait` seconds. Reports, as JSON: the neighbour's median latency before and
during, and its worst; `vllm:num_requests_running` on the HTTP /metrics at the end (taken
during one of the neighbour's streams, so 1 = only the neighbour); the orchestrator's RSS
before the clients and at the end; paused sequences and write-timeout cancellations; the
sequences the services hold at the end.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import click
import psutil

from specdecode_stack.local import LocalStack, StackConfig, free_port

TEXT = "Write a long story about a lighthouse keeper."
IDS = [5, 17, 99, 3]  # the tiny pair has no tokenizer


def completion(base: str, prompt, stream: bool = False) -> float:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "stream": stream}).encode()
    request = urllib.request.Request(base + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as r:
        r.read()
    return time.monotonic() - start


def never_read(port: int, prompt, max_tokens: int) -> socket.socket:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def tiny_dirs(root: Path) -> tuple[str, str]:
    from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
    for name, seed, layers in (("target", 1, 2), ("draft", 2, 1)):
        build_tiny_model(dataclasses.replace(TinyModelSpec(seed=seed, num_layers=layers),
                                             max_position_embeddings=8192)
                         ).save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def drill(stack: LocalStack, http_port: int, prompt, clients: int, max_tokens: int,
          wait: float) -> dict:
    """The neighbour alone, then beside `clients` never-read streams for `wait` seconds."""
    base = f"http://127.0.0.1:{http_port}"
    orch = psutil.Process(stack.processes["orchestrator"].pid)
    metrics_url = f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}/metrics"
    for _ in range(3):
        completion(base, prompt)  # warm-up
    before = [completion(base, prompt) for _ in range(8)]
    rss_before = orch.memory_info().rss
    socks = [never_read(http_port, prompt, max_tokens) for _ in range(clients)]
    during, paused_max, start = [], 0.0, time.monotonic()
    while time.monotonic() - start < wait:
        during.append(completion(base, prompt))
        paused_max = max(paused_max, metric(scrape(metrics_url), "specdecode_paused_sequences"))
    seen: list[float] = []  # the running count during one of the neighbour's own streams
    neighbour = threading.Thread(target=completion, args=(base, prompt, True))
    neighbour.start()
    seen.append(metric(scrape(base + "/metrics"), "vllm:num_requests_running"))
    neighbour.join()
    text = scrape(metrics_url)
    result = {
        "neighbour_median_before_s": statistics.median(before),
        "neighbour_median_during_s": statistics.median(during),
        "neighbour_worst_during_s": max(during), "neighbour_requests_during": len(during),
        "neighbour_median_ratio": statistics.median(during) / statistics.median(before),
        "vllm_num_requests_running_at_end": seen[0], "paused_sequences_max": paused_max,
        "write_timeouts": metric(text, "specdecode_stream_write_timeouts_total"),
        "orchestrator_rss_before_mib": rss_before / 2**20,
        "orchestrator_rss_growth_mib": (orch.memory_info().rss - rss_before) / 2**20,
    }
    for role in ("proposer", "scorer"):
        result[f"{role}_sequences_held"] = metric(scrape(
            f"http://127.0.0.1:{stack.metrics_ports[role]}/metrics"),
            "specdecode_kv_cache_sequences")
    for s in socks:
        s.close()
    return result


@click.command()
@click.option("--model", type=click.Choice(["smollm2", "tiny"]), default="smollm2")
@click.option("--clients", default=16)
@click.option("--max-tokens", default=6000)
@click.option("--write-timeout", default=30.0)
@click.option("--wait", default=90.0)
@click.option("--out", default=None)
def main(model, clients, max_tokens, write_timeout, wait, out):
    root = Path(tempfile.mkdtemp(prefix="never_read_"))
    kw = {}
    if model == "tiny":
        target, draft = tiny_dirs(root)
        kw = {"target_model": target, "draft_model": draft, "tokenizer": "none"}
    http_port = free_port()
    config = StackConfig(http_port=http_port, log_file=str(root / "stack.log"),
                         orchestrator_args=["--stream-write-timeout", str(write_timeout)], **kw)
    with LocalStack(config) as stack:
        result = {"model": model, "clients": clients, "max_tokens": max_tokens,
                  "write_timeout_s": write_timeout, "wait_s": wait,
                  **drill(stack, http_port, IDS if model == "tiny" else TEXT, clients,
                          max_tokens, wait)}
    print(json.dumps(result, indent=2))
    if out:
        Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
