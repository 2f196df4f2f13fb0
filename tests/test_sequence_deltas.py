"""Per-step traffic that grows with new tokens, not context: sequence deltas (the
orchestrator's DeltaEncoder, a service's TokenStore) and the full resend when a service
lacks a prefix, down to a scorer or proposer restarted mid-stream."""

from __future__ import annotations

import signal
import time

from specdecode.api.client import SpecDecodeClient
from specdecode.deltas.encoder import DeltaEncoder
from specdecode_stack.local import LocalStack, StackConfig
from specdecode import wire
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.deltas.store import TokenStore, extend_hash, resolve_request
from tests.conftest import reference_greedy, scrape_metrics


def request(seqs: dict[int, tuple[list[int], list[int]]], k: int = 3) -> ExecuteModelRequest:
    return ExecuteModelRequest([
        SequenceGroupMetadata(f"r{sid}", not out, {sid: SequenceData(prompt, list(out))},
                              SamplingParams(temperature=0.5, top_p=0.9, seed=sid))
        for sid, (prompt, out) in seqs.items()], k)


def receive(store: TokenStore, encoded) -> tuple[ExecuteModelRequest, list[int]]:
    """What a service does with a step request: decode, then complete from its store."""
    req = wire.request_from_proto(encoded)
    return req, resolve_request(encoded, req, store)


def test_store_rebuilds_checks_the_hash_and_rolls_back():
    store = TokenStore()
    store.put(7, SequenceData([1, 2, 3], [4]))
    h4 = extend_hash(0, [1, 2, 3, 4])
    assert store.extend(7, 4, h4, [5, 6]) == SequenceData([1, 2, 3], [4, 5, 6])
    assert store.extend(7, 4, h4 + 1, [5]) is None  # another prefix
    assert store.extend(7, 2, extend_hash(0, [1, 2]), []) is None  # shorter than the prompt
    assert store.extend(8, 4, h4, [5]) is None  # never seen
    # A delta against an older length (the caller never saw the last call succeed) still
    # resolves: the record keeps a hash per length and rolls back to the prefix.
    assert store.extend(7, 4, h4, [9]) == SequenceData([1, 2, 3], [4, 9])
    assert store.extend(7, 6, extend_hash(0, [1, 2, 3, 4, 5, 6]), []) is None
    store.put(7, SequenceData([1, 2, 3], [4, 9, 10]))  # full form extends the record
    assert store.num_tokens == 6 and store.release([7, 8]) == 1 and store.num_tokens == 0


def test_store_is_bounded_least_recently_used_first():
    store = TokenStore(max_sequences=2, max_tokens=10)
    for sid in (1, 2, 3):
        store.put(sid, SequenceData([sid] * 3))
    assert len(store) == 2 and store.extend(1, 3, extend_hash(0, [1] * 3), []) is None
    store.extend(2, 3, extend_hash(0, [2] * 3), [0] * 4)  # 7 + 3 tokens: at the bound
    store.put(4, SequenceData([4] * 2))  # over it: sequence 3 (least recent) goes
    assert store.num_tokens == 9 and store.extend(3, 3, extend_hash(0, [3] * 3), []) is None


def test_deltas_round_trip_and_do_not_grow_with_context():
    encoder, store = DeltaEncoder(), TokenStore()
    sizes = {}
    for context in (256, 4096):
        prompt = [t % 200 for t in range(context)]
        first = request({context: (prompt, [])})
        got, missing = receive(store, encoder.encode(first))
        assert not missing and got == first
        encoder.commit(first)
        out = []
        for step in range(4):  # each step appends 1..3 tokens
            out += [step] * (1 + step % 3)
            req = request({context: (prompt, out)})
            encoded = encoder.encode(req)
            got, missing = receive(store, encoded)
            assert not missing and got == req, step
            encoder.commit(req)
        sizes[context] = encoded.ByteSize()
    # The 4096-token prompt is not resent; only varint widths (id, length) differ.
    assert abs(sizes[4096] - sizes[256]) <= 4 and sizes[4096] < 128, sizes


def test_a_prompt_prefilled_in_chunks_travels_once():
    """Chunked prefill sends longer and longer prefixes of the prompt (then the prompt with
    generated tokens): each chunk's delta carries only the prompt tokens after the last."""
    encoder, store = DeltaEncoder(), TokenStore()
    prompt = list(range(100))
    for prefix, out in ((prompt[:40], []), (prompt[:80], []), (prompt, []), (prompt, [7, 8])):
        req = request({5: (prefix, out)})
        encoded = encoder.encode(req)
        got, missing = receive(store, encoded)
        assert not missing and got == req, len(prefix)
        sent = encoded.seq_group_metadata_list[0].seq_data[5]
        assert len(sent.prompt_token_ids) + len(sent.output_token_ids) <= 40, len(prefix)
        encoder.commit(req)


def test_missing_prefix_is_reported_and_resent_in_full():
    encoder = DeltaEncoder()
    first = request({1: ([5, 6, 7], []), 2: ([8, 9], [])})
    encoder.commit(first)
    step = request({1: ([5, 6, 7], [1]), 2: ([8, 9], [2, 3])})
    fresh = TokenStore()  # a restarted service: holds nothing
    fresh.put(2, SequenceData([8, 9]))
    _, missing = receive(fresh, encoder.encode(step))
    assert missing == [1]
    got, missing = receive(fresh, encoder.encode(step, full={1}))
    assert not missing and got == step


# -- through the stack ----------------------------------------------------------------------

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
                                # Call deadlines far away: the call to the paused service
                                # is not "late".
                                extra_env={**{f"SPECDECODE_{t}_TIMEOUT": "600" for t in (
                                               "PROPOSER", "SCORER", "SCORER_RETRY")}})) \
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
