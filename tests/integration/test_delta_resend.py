"""A scorer or proposer restarted mid-stream holds no sequence: the orchestrator resends
it in full and the output is unchanged (real processes)."""

from __future__ import annotations

import signal
import time

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig
from tests.support.metrics import scrape_metrics
from tests.support.references import reference_greedy

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
MAX_TOKENS = 120


def full_resends(stack: LocalStack) -> dict[str, float]:
    metrics = scrape_metrics(stack.metrics_ports["orchestrator"])
    return {role: metrics.get(f'specdecode_full_resends_total{{role="{role}"}}', 0.0)
            for role in ("proposer", "scorer")}


def replica_up(stack: LocalStack, role: str) -> bool:
    metrics = scrape_metrics(stack.metrics_ports["orchestrator"])
    return any(v == 1 for k, v in metrics.items()
               if k.startswith("specdecode_replica_up{") and f'role="{role}"' in k)


def test_restart_mid_stream_resends_in_full_and_output_is_unchanged(tiny_model_dirs,
                                                                   target_model):
    """A service restarted mid-stream holds no sequence: its next step call names the
    sequence missing, the orchestrator resends it in full within that step, and the stream
    equals target-only greedy decoding; first the scorer restarts under one stream, then the
    proposer under another. While one service restarts, the other is paused (SIGSTOP), so
    the stream waits in a step, still running, until the orchestrator has the restarted
    service back on its ring: this test is about lost state, not retries or fallback."""
    want = reference_greedy(target_model, PROMPT, MAX_TOKENS)
    with LocalStack(StackConfig(target_model=tiny_model_dirs["target"],
                                draft_model=tiny_model_dirs["draft"], tokenizer="none",
                                device="cpu", num_speculative_tokens=3, port=0,
                                speculation="fixed",  # the proposer is asked every step
                                grace_seconds=1.0,
                                # Call deadlines and the keepalive far away: the call to
                                # the paused service is not "late", its link not "quiet".
                                extra_env={**{f"SPECDECODE_{t}_TIMEOUT": "600" for t in (
                                               "PROPOSER", "SCORER", "SCORER_RETRY",
                                               "KEEPALIVE")}})) \
            as stack, \
            SpecDecodeClient(stack.address) as client:
        resends = [full_resends(stack)]
        for role, other in (("scorer", "proposer"), ("proposer", "scorer")):
            stream = client.stream(PROMPT, max_tokens=MAX_TOKENS)
            # Two messages: the prompt's step (scorer only) and a speculative one (the
            # proposer has now received the sequence too).
            tokens = list(next(stream).token_ids) + list(next(stream).token_ids)
            paused = stack.processes[other]
            paused.send_signal(signal.SIGSTOP)
            try:
                stack.restart(role)
                deadline = time.monotonic() + 60
                while not replica_up(stack, role):  # the health check puts it back
                    assert time.monotonic() < deadline, f"{role} not back on the ring"
                    time.sleep(0.2)
            finally:
                paused.send_signal(signal.SIGCONT)
            tokens += [t for r in stream for t in r.token_ids]
            assert tokens == want, role
            resends.append(full_resends(stack))
    assert resends[0] == {"scorer": 0, "proposer": 0}
    assert resends[1]["scorer"] >= 1 and resends[1]["proposer"] == 0, resends  # scorer restarted
    assert resends[2]["proposer"] >= 1 and resends[2]["scorer"] == resends[1]["scorer"], resends
