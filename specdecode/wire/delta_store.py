"""A service's record of each sequence's token ids, by sequence id: the base that a delta
request extends (DESIGN invariant 3, "a length and hash when only appended tokens travel").

After a sequence's first step, the orchestrator sends a service only the tokens appended
since that service last received the sequence, with the length and hash of the prefix it
left out (`SequenceData.prefix`). The service rebuilds the full ids from this record; when
the record is absent or holds another prefix (restart, eviction, another replica) the
sequence is reported missing and the orchestrator resends it in full, within the same step.

The record is independent of the KV cache: evicting KV state forces a recompute, not a
resend. It is bounded (least recently used sequences go first when there are more than
`max_sequences` or more than `max_tokens` tokens in all) and released with the sequence.
Tokens and prefix hashes live in compact arrays: 16 bytes per token.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from specdecode.sequence import ExecuteModelRequest, SequenceData
from specdecode.v1 import sequence_pb2

HASH_BASE = 1_000_003
HASH_MOD = (1 << 61) - 1  # a Mersenne prime: collisions of two different prefixes ~ n / 2^61


def extend_hash(h: int, tokens: Iterable[int]) -> int:
    """The prefix hash after appending `tokens` to a prefix whose hash is h (0 = empty)."""
    for t in tokens:
        h = (h * HASH_BASE + t + 1) % HASH_MOD
    return h


def running_hashes(tokens: Iterable[int], h: int = 0) -> Iterable[int]:
    """The hash after each token in turn, from a prefix whose hash is h."""
    for t in tokens:
        h = (h * HASH_BASE + t + 1) % HASH_MOD
        yield h


@dataclass
class _Record:
    prompt_len: int
    tokens: array  # 'q' [n]
    hashes: array  # 'Q' [n + 1]: hashes[i] = hash of tokens[:i]

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        del self.hashes[n + 1:]

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.hashes.extend(running_hashes(tokens, self.hashes[-1]))


class TokenStore:
    def __init__(self, max_sequences: int = 4096, max_tokens: int = 1 << 22):
        if max_sequences < 1 or max_tokens < 1:
            raise ValueError(f"TokenStore bounds must be >= 1, got {max_sequences}, {max_tokens}")
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self._records: OrderedDict[int, _Record] = OrderedDict()
        self.num_tokens = 0  # tokens held over all records

    def __len__(self) -> int:
        return len(self._records)

    def put(self, seq_id: int, data: SequenceData) -> None:
        """Record a sequence received in the full form (prompt and every generated token)."""
        tokens = data.get_token_ids()
        record = self._records.get(seq_id)
        if record is not None and record.prompt_len == len(data.prompt_token_ids):
            n = min(len(record.tokens), len(tokens))
            if record.tokens[:n] == array("q", tokens[:n]):  # compared in C: O(n), fast
                self._replace(seq_id, record, n, tokens[n:])
                return
        self.release([seq_id])
        record = _Record(len(data.prompt_token_ids), array("q"), array("Q", [0]))
        self._records[seq_id] = record
        self._replace(seq_id, record, 0, tokens)

    def extend(self, seq_id: int, prefix_len: int, prefix_hash: int, appended: list[int],
               appended_prompt: list[int] = ()) -> SequenceData | None:
        """The full sequence: the recorded prefix of `prefix_len` tokens, checked against
        `prefix_hash`, then `appended_prompt` (the prompt grew: only after a prefix that is
        the whole recorded prompt) and `appended` (generated tokens); it becomes the record.
        None when this store does not hold that prefix."""
        record = self._records.get(seq_id)
        if (record is None or not record.prompt_len <= prefix_len <= len(record.tokens)
                or record.hashes[prefix_len] != prefix_hash
                or (appended_prompt and prefix_len != record.prompt_len)):
            return None
        if appended_prompt:
            record.prompt_len += len(appended_prompt)
            appended = [*appended_prompt, *appended]
        self._replace(seq_id, record, prefix_len, appended)
        tokens = record.tokens
        return SequenceData(tokens[:record.prompt_len].tolist(),
                            tokens[record.prompt_len:].tolist())

    def release(self, seq_ids: Iterable[int]) -> int:
        """Forget sequences; returns how many were held."""
        released = 0
        for seq_id in seq_ids:
            record = self._records.pop(seq_id, None)
            if record is not None:
                self.num_tokens -= len(record.tokens)
                released += 1
        return released

    def _replace(self, seq_id: int, record: _Record, keep: int, appended: list[int]) -> None:
        self.num_tokens += keep + len(appended) - len(record.tokens)
        record.truncate(keep)
        record.append(appended)
        self._records.move_to_end(seq_id)
        while len(self._records) > 1 and (len(self._records) > self.max_sequences
                                          or self.num_tokens > self.max_tokens):
            self.release([next(iter(self._records))])


def resolve_request(m: sequence_pb2.ExecuteModelRequest, req: ExecuteModelRequest,
                    store: TokenStore) -> list[int]:
    """Complete the decoded request `req` of message `m` in place: a sequence in the delta
    form gets its full ids from the store; one in the full form is recorded. Returns the ids
    of delta sequences whose prefix the store does not hold (their entries stay partial:
    the request must not run)."""
    missing = []
    for m_sg, sg in zip(m.seq_group_metadata_list, req.seq_group_metadata_list):
        for seq_id, data in sg.seq_data.items():
            m_data = m_sg.seq_data[seq_id]
            if not m_data.HasField("prefix"):
                store.put(seq_id, data)
                continue
            full = store.extend(seq_id, m_data.prefix.length, m_data.prefix.hash,
                                data.output_token_ids, data.prompt_token_ids)
            if full is None:
                missing.append(seq_id)
            else:
                sg.seq_data[seq_id] = full
    return missing
