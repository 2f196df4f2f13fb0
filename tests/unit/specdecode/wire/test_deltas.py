"""Per-step traffic that grows with new tokens, not context: sequence deltas (the
orchestrator's DeltaEncoder, a service's TokenStore) and the full resend when a
service lacks a prefix."""

from __future__ import annotations

from specdecode.wire import codec
from specdecode.wire.delta_encoder import DeltaEncoder
from specdecode.wire.delta_store import TokenStore, extend_hash, resolve_request
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)


def request(seqs: dict[int, tuple[list[int], list[int]]], k: int = 3) -> ExecuteModelRequest:
    return ExecuteModelRequest([
        SequenceGroupMetadata(f"r{sid}", not out, {sid: SequenceData(prompt, list(out))},
                              SamplingParams(temperature=0.5, top_p=0.9, seed=sid))
        for sid, (prompt, out) in seqs.items()], k)


def receive(store: TokenStore, encoded) -> tuple[ExecuteModelRequest, list[int]]:
    """What a service does with a step request: decode, then complete from its store."""
    req = codec.request_from_proto(encoded)
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
