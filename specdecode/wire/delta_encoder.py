"""Per-step traffic that grows with new tokens, not with context: what one service (one
replica: hold one DeltaEncoder per connection) last received of each sequence, and the
step's request encoded against it.

A sequence travels in full the first time; after that only the tokens after the prefix it
shares with what the service last received, with that prefix's length and hash
(`SequenceData.prefix`, see specdecode.wire.delta_store). Usually the sequence grew and the
shared prefix is all that was sent; after a lookahead (asynchronous drafting: a proposer
call that assumed a proposal accepted, orchestrator.engine.lookahead) the real sequence may
part from what was sent within its last tokens, and the delta then rolls the service's
record back to where they part. That point is searched within the last TAIL tokens sent
(a lookahead assumes at most MAX_K + 1); a sequence that parts earlier travels in full.
When the service answers that it lacks some prefixes (`missing_seq_ids`: restarted,
evicted, another replica), the caller resends those sequences in full within the same
step, so the output never depends on what a service remembers (DESIGN invariant 3).

Thread safety: one step call at a time per encoder, but `forget` (a release) may come from
another thread, so the table is guarded by a lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable

from specdecode.wire import codec
from specdecode.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from specdecode.wire.delta_store import running_hashes
from specdecode.v1 import sequence_pb2

TAIL = 64  # tokens sent last, per sequence, within which a rollback is found


@dataclasses.dataclass(frozen=True)
class _Sent:
    """What the service received of one sequence: `length` tokens (prompt first, then
    generated), the last of them in `tokens`, and hashes[i] = the hash of its first
    `start + i` tokens (i = 0 .. len(tokens))."""

    length: int
    tokens: tuple[int, ...]
    hashes: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.length - len(self.tokens)

    def shared(self, data: SequenceData) -> int | None:
        """How many first tokens `data` shares with what was sent (everything before the
        tail is taken as shared); None when it shares none of the tail (it may part before
        it: where is unknown)."""
        prompt_tail, output_tail = _after(data, self.start)
        ids = [*prompt_tail, *output_tail]
        i = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            i += 1
        if i == 0 and self.start > 0:
            return None
        return self.start + i


class DeltaEncoder:
    def __init__(self):
        self._sent: dict[int, _Sent] = {}  # seq id -> what the service last received
        self._lock = threading.Lock()

    def encode(self, req: ExecuteModelRequest,
               full: Collection[int] = ()) -> sequence_pb2.ExecuteModelRequest:
        """The step's request with every sequence the service received before in the delta
        form (against the prefix it shares with what was sent), except those in `full`."""
        with self._lock:
            sent = {sg.seq_id: self._sent.get(sg.seq_id) for sg in req.seq_group_metadata_list}
        groups = []
        for sg, s in zip(req.seq_group_metadata_list, sent.values()):
            shared = None if s is None or sg.seq_id in full else s.shared(sg.data)
            groups.append(codec.sequence_group_metadata_to_proto(sg) if shared is None
                          else _delta_to_proto(sg, shared, s.hashes[shared - s.start]))
        return sequence_pb2.ExecuteModelRequest(seq_group_metadata_list=groups,
                                                num_lookahead_slots=req.num_lookahead_slots,
                                                draft_ahead=req.draft_ahead)

    def commit(self, req: ExecuteModelRequest) -> None:
        """The service received `req`: its sequences' current ids are what it holds."""
        updates = {}
        with self._lock:
            before = {sg.seq_id: self._sent.get(sg.seq_id) for sg in req.seq_group_metadata_list}
        for sg in req.seq_group_metadata_list:
            s, data = before[sg.seq_id], sg.data
            shared = None if s is None else s.shared(data)
            if shared is not None and shared == s.length == data.get_len():
                continue
            if shared is None:  # from scratch: hash every token
                shared, tokens, hashes = 0, [], [0]
            else:  # keep what is shared, hash only what follows it
                keep = shared - s.start
                tokens, hashes = list(s.tokens[:keep]), list(s.hashes[:keep + 1])
            prompt_tail, output_tail = _after(data, shared)
            tail = [*prompt_tail, *output_tail]
            tokens += tail
            hashes += running_hashes(tail, hashes[-1])
            cut = max(0, len(tokens) - TAIL)
            updates[sg.seq_id] = _Sent(data.get_len(), tuple(tokens[cut:]), tuple(hashes[cut:]))
        with self._lock:
            self._sent.update(updates)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Send these sequences in full next time (released, or missing on the service)."""
        with self._lock:
            for seq_id in seq_ids:
                self._sent.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._sent)


def _after(data: SequenceData, n: int) -> tuple[list[int], list[int]]:
    """The prompt tokens and the generated tokens of `data` after its first n tokens."""
    p = len(data.prompt_token_ids)
    if n < p:  # the prompt grew since (prefilled in chunks)
        return data.prompt_token_ids[n:], list(data.output_token_ids)
    return [], data.output_token_ids[n - p:]


def _delta_to_proto(sg: SequenceGroupMetadata, length: int,
                    prefix_hash: int) -> sequence_pb2.SequenceGroupMetadata:
    """sg with only the tokens after its first `length` (whose hash is prefix_hash)."""
    m = codec.sequence_group_metadata_to_proto(dataclasses.replace(sg, seq_data={}))
    prompt_tail, output_tail = _after(sg.data, length)
    m.seq_data[sg.seq_id].CopyFrom(sequence_pb2.SequenceData(
        prompt_token_ids=prompt_tail, output_token_ids=output_tail,
        prefix=sequence_pb2.SequencePrefix(length=length, hash=prefix_hash)))
    return m
