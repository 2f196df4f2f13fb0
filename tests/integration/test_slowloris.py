"""bench/reliability_bench.py's slowloris drill at CI size, over real processes (the tiny pair, HTTP on
127.0.0.1): connections that dribble a request head a byte a second are closed by the server
at --http-header-timeout, and a neighbour's completions meanwhile all succeed. Bounds on
events, not speeds: no latency ratio is asserted (the bench reports it)."""

from __future__ import annotations

from bench.reliability_bench import IDS, Closes, drill
from specdecode_stack.local import LocalStack, StackConfig, free_port

CONNECTIONS = 20
HEADER_TIMEOUT_S = 1.5
SECONDS = 12.0  # how long they dribble: 8x the header timeout


def test_dribbling_request_heads_are_closed_at_the_header_timeout(tiny_model_dirs):
    """Each of 20 connections sends a request line, a Host header, then a header byte a
    second and never the blank line ending the head. Every one must be closed by the server
    within the 12 s window, none before the 1.5 s header timeout (so it is that timer that
    closes them), none answered first (the connection limit, 1024, is not reached), and the
    neighbour's completions before and during must all succeed.

    Without the header timeout nothing would close them: uvicorn's own keep-alive timer is
    armed only after a response, and h11's 32 KiB bound on an incomplete head would take
    hours at a byte a second; all 20 would still be open at the end and the test fails."""
    config = StackConfig(target_model=tiny_model_dirs["target"],
                         draft_model=tiny_model_dirs["draft"], tokenizer="none", device="cpu",
                         num_speculative_tokens=3, port=0, http_port=free_port(),
                         orchestrator_args=["--http-header-timeout", str(HEADER_TIMEOUT_S)])
    with LocalStack(config):
        run = drill(config.http_port, IDS, CONNECTIONS, SECONDS, requests=4)
    open_at_end = [d for d in run.dribblers if d.closed_at is None]
    assert not open_at_end, f"{len(open_at_end)} of {CONNECTIONS} still open after {SECONDS} s"
    early = [d.closed_after for d in run.dribblers if d.closed_after < HEADER_TIMEOUT_S]
    assert not early, f"closed before the header timeout: {early}"
    assert not [d.answer for d in run.dribblers if d.answer], "answered, not timed out"
    errors = [c.error for c in run.before + run.during if c.error]
    assert not errors, errors
    assert run.during, "the neighbour completed nothing during the drill"
    closes = Closes.of(run.dribblers)
    print(f"\n{CONNECTIONS} dribbling connections closed after {closes.median_s:.2f} s "
          f"(median), {closes.max_s:.2f} s (max); neighbour {len(run.during)} completions "
          f"during, no errors")
