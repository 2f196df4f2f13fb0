"""Per-step traffic that grows with new tokens, not with context: what one service (one
replica: hold one DeltaEncoder per connection) last received of each sequence, and the
step's request encoded against it.

A sequence travels in full the first time; after that only the tokens appended since the
service last received it, with the length and hash of the prefix left out
(`SequenceData.prefix`, see specdecode.deltas.store). When the service answers that it lacks
some prefixes (`missing_seq_ids`: restarted, evicted, another replica), the caller resends
those sequences in full within the same step, so the output never depends on what a service
remembers (DESIGN invariant 3).

Thread safety: one step call at a time per encoder, but `forget` (a release) may come from
another thread, so the table is guarded by a lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable

from specdecode import wire
from specdecode.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from specdecode.deltas.store import extend_hash
from specdecode.v1 import sequence_pb2


@dataclasses.dataclass(frozen=True)
class _Sent:
    length: int  # tokens the service received (prompt first, then generated)
    hash: int  # their prefix hash


class DeltaEncoder:
    def __init__(self):
        self._sent: dict[int, _Sent] = {}  # seq id -> what the service last received
        self._lock = threading.Lock()

    def encode(self, req: ExecuteModelRequest,
               full: Collection[int] = ()) -> sequence_pb2.ExecuteModelRequest:
        """The step's request with every sequence the service received before in the delta
        form, except those in `full`."""
        with self._lock:
            sent = {sg.seq_id: self._sent.get(sg.seq_id) for sg in req.seq_group_metadata_list}
        return sequence_pb2.ExecuteModelRequest(
            seq_group_metadata_list=[
                wire.sequence_group_metadata_to_proto(sg)
                if s is None or sg.seq_id in full or s.length > sg.data.get_len()
                else _delta_to_proto(sg, s) for sg, s in
                zip(req.seq_group_metadata_list, sent.values())],
            num_lookahead_slots=req.num_lookahead_slots)

    def commit(self, req: ExecuteModelRequest) -> None:
        """The service received `req`: its sequences' current ids become their prefixes."""
        updates = {}
        with self._lock:
            before = {sg.seq_id: self._sent.get(sg.seq_id) for sg in req.seq_group_metadata_list}
        for sg in req.seq_group_metadata_list:
            s, data = before[sg.seq_id], sg.data
            n = data.get_len()
            if s is not None and s.length == n:
                continue
            if s is None or s.length > n:
                h = extend_hash(0, data.get_token_ids())
            else:  # only the appended tokens
                prompt_tail, output_tail = _after(data, s.length)
                h = extend_hash(extend_hash(s.hash, prompt_tail), output_tail)
            updates[sg.seq_id] = _Sent(n, h)
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


def _delta_to_proto(sg: SequenceGroupMetadata, sent: _Sent) -> sequence_pb2.SequenceGroupMetadata:
    """sg with only the tokens after the `sent` prefix."""
    m = wire.sequence_group_metadata_to_proto(dataclasses.replace(sg, seq_data={}))
    prompt_tail, output_tail = _after(sg.data, sent.length)
    m.seq_data[sg.seq_id].CopyFrom(sequence_pb2.SequenceData(
        prompt_token_ids=prompt_tail, output_token_ids=output_tail,
        prefix=sequence_pb2.SequencePrefix(length=sent.length, hash=sent.hash)))
    return m
