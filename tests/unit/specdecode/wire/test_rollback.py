"""Deltas after a lookahead (asynchronous drafting): a proposer call that assumed a proposal
accepted leaves the service holding tokens the real sequence does not have; the next delta
rolls the service's record back to where they part, with no full resend."""

from __future__ import annotations

from specdecode.wire import codec
from specdecode.wire.delta_encoder import TAIL, DeltaEncoder
from specdecode.wire.delta_store import TokenStore, resolve_request
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)

PROMPT = list(range(10, 40))


def step(out: list[int], seq_id: int = 5) -> ExecuteModelRequest:
    return ExecuteModelRequest([SequenceGroupMetadata(
        "r", False, {seq_id: SequenceData(PROMPT, list(out))}, SamplingParams())], 4)


def send(encoder: DeltaEncoder, store: TokenStore, req: ExecuteModelRequest):
    """One call: encoded, received (checked against the request), committed."""
    encoded = encoder.encode(req)
    got = codec.request_from_proto(encoded)
    assert resolve_request(encoded, got, store) == []  # nothing missing: no full resend
    assert got.seq_group_metadata_list[0].data == req.seq_group_metadata_list[0].data
    encoder.commit(req)
    return encoded.seq_group_metadata_list[0].seq_data[5]


def test_a_rejected_lookahead_rolls_the_record_back_in_a_delta():
    encoder, store = DeltaEncoder(), TokenStore()
    send(encoder, store, step([1]))  # full
    # The lookahead assumed proposals 2, 3, 4 accepted; the verify rejected 3 (target: 7).
    ahead = send(encoder, store, step([1, 2, 3, 4]))
    assert ahead.HasField("prefix") and list(ahead.output_token_ids) == [2, 3, 4]
    back = send(encoder, store, step([1, 2, 7]))
    assert back.HasField("prefix") and back.prefix.length == len(PROMPT) + 2
    assert list(back.output_token_ids) == [7]
    # Same length as what was sent, other last token: rolled back by one, not taken as equal.
    same = send(encoder, store, step([1, 2, 8]))
    assert same.prefix.length == len(PROMPT) + 2 and list(same.output_token_ids) == [8]
    # A shorter sequence (its lookahead assumed more than it kept).
    send(encoder, store, step([1, 2, 8, 9, 10, 11]))
    short = send(encoder, store, step([1, 2, 8, 9]))
    assert short.prefix.length == len(PROMPT) + 4 and list(short.output_token_ids) == []


def test_a_long_run_keeps_only_the_tail_and_parts_before_it_travel_in_full():
    encoder, store = DeltaEncoder(), TokenStore()
    out = [1]
    send(encoder, store, step(out))
    for t in range(2, 2 + 2 * TAIL):
        out.append(t)
        assert send(encoder, store, step(out)).HasField("prefix")
    # Rolled back to before the tail's start: where they part is unknown, so in full.
    diverged = [*out[:len(out) - TAIL - 1], 999]
    assert not send(encoder, store, step(diverged)).HasField("prefix")
