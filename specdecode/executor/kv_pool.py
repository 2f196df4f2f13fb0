"""The KV cache pool of one service: allocated once from a memory budget, written in place.

Layout (docs/design.md, Executor): one tensor holds every layer's keys and values for a fixed
number of token slots, grouped in blocks of `block_size` tokens. Each cached sequence owns an
*extent*, a run of consecutive blocks, so its keys and values are one strided view of the pool:
the CPU attention reads that view directly (no gather, no padded copy), and a paged kernel on an
accelerator reads it through a block table whose ids happen to be consecutive.

Why extents rather than scattered pages: on CPU, scattered pages need a gather per layer per
step (measured: as costly as the attention itself at 3,000 tokens), and PyTorch's CPU attention
has no paged variant. The price is relocation: a sequence that outgrows its extent while the
next blocks are taken is moved once (one copy of its tokens; extents get 25% headroom, so this
is amortised), and a fragmented pool is compacted before anything is evicted for lack of a hole.

Stateless semantics, cached execution (docs/design.md, invariant 3): an entry is only a hint. Rolling
back after a rejection is a length change (the entry's token list is cut); a full pool evicts
the least recently used sequence not in the current batch, whose next request recomputes it.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


class PoolFull(Exception):
    """The sequences of one batch do not fit together: the caller runs it in parts."""


@dataclass
class PoolEntry:
    token_ids: list[int]  # tokens whose keys/values are held: token i at slot start + i
    start: int  # first token slot of the extent (a multiple of block_size)
    capacity: int  # token slots reserved (whole blocks)


@dataclass
class PoolStats:
    evictions: int = 0  # entries dropped to make room (recomputed when they come back)
    relocations: int = 0  # entries moved to a larger extent
    compactions: int = 0  # whole-pool defragmentations


@dataclass
class KVPool:
    """Extent allocator over `num_blocks` blocks, with per-sequence entries in LRU order.

    `kv` is allocated by the attention backend ([layers, 2, ...] with the token slots along
    dimension `token_dim`); the pool moves slots within it and never reallocates it.
    """

    kv: torch.Tensor
    token_dim: int
    block_size: int
    max_num_seqs: int
    stats: PoolStats = field(default_factory=PoolStats)

    def __post_init__(self):
        self.num_blocks = self.kv.shape[self.token_dim] // self.block_size
        self._entries: OrderedDict[int, PoolEntry] = OrderedDict()  # least recent first
        self._free: list[tuple[int, int]] = [(0, self.num_blocks)]  # (first block, count), sorted

    # -- what the runner and the metrics read ------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_sequences(self) -> int:
        return len(self._entries)

    @property
    def tokens_held(self) -> int:
        return sum(len(e.token_ids) for e in self._entries.values())

    @property
    def tokens_reserved(self) -> int:
        return sum(e.capacity for e in self._entries.values())

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def get(self, cache_id: int) -> PoolEntry | None:
        return self._entries.get(cache_id)

    def release(self, cache_ids: list[int]) -> int:
        """Drop entries; returns how many existed."""
        return sum(self._drop(i) for i in cache_ids)

    def fits(self, rows: dict[int, int]) -> bool:
        """Whether entries of rows[cache_id] tokens each fit beside every other entry, with
        nothing evicted (the slots free now, whole blocks; at most max_num_seqs entries)."""
        new = [c for c in rows if c not in self._entries]
        if len(self._entries) + len(new) > self.max_num_seqs:
            return False
        extra = 0
        for cache_id, tokens in rows.items():
            entry = self._entries.get(cache_id)
            extra += self._blocks(max(tokens - (entry.capacity if entry else 0), 0))
        free = self.num_blocks - sum(e.capacity for e in self._entries.values()) // self.block_size
        return extra <= free

    # -- reserving room ----------------------------------------------------------------------
    def reserve(self, cache_id: int, tokens: int, keep: int, pinned: set[int]) -> PoolEntry:
        """An entry for `cache_id` with room for `tokens` tokens whose first `keep` cached
        tokens are preserved (the rest of its token list is cut: the rollback). Evicts least
        recently used entries outside `pinned` as needed; raises PoolFull when even that
        cannot make room. The entry's token list is the caller's to extend after writing."""
        entry = self._entries.get(cache_id)
        if entry is not None:
            keep = min(keep, len(entry.token_ids))
            del entry.token_ids[keep:]
            self._entries.move_to_end(cache_id)
            if entry.capacity < tokens and not self._extend(entry, tokens):
                try:
                    self._relocate(entry, tokens, pinned | {cache_id})
                except PoolFull:
                    self._drop(cache_id)
                    raise
            return entry
        if len(self._entries) >= self.max_num_seqs:
            self._evict_one(pinned)
        need = self._blocks(tokens)
        start, n = self._allocate(need, need + self._headroom(need), pinned)
        entry = self._entries[cache_id] = PoolEntry([], start * self.block_size,
                                                    n * self.block_size)
        return entry

    def _blocks(self, tokens: int) -> int:
        return max(1, -(-tokens // self.block_size))

    @staticmethod
    def _headroom(blocks: int) -> int:
        return max(1, blocks // 4)

    def _extend(self, entry: PoolEntry, tokens: int) -> bool:
        """Grow in place when the blocks after the extent are free."""
        if not entry.capacity:
            return False
        first, have = entry.start // self.block_size, entry.capacity // self.block_size
        need = self._blocks(tokens)
        i = bisect.bisect_left(self._free, (first + have, 0))
        if i == len(self._free) or self._free[i][0] != first + have or \
                have + self._free[i][1] < need:
            return False
        grow = min(self._free[i][1], need - have + self._headroom(need))
        free_start, free_n = self._free[i]
        if grow == free_n:
            del self._free[i]
        else:
            self._free[i] = (free_start + grow, free_n - grow)
        entry.capacity = (have + grow) * self.block_size
        return True

    def _relocate(self, entry: PoolEntry, tokens: int, pinned: set[int]) -> None:
        need = self._blocks(tokens)
        keep = len(entry.token_ids)
        if keep == 0:  # nothing to carry over: free first, so its own blocks can be reused
            if entry.capacity:
                self._give(entry.start // self.block_size, entry.capacity // self.block_size)
            entry.capacity = 0
            start, n = self._allocate(need, need + self._headroom(need), pinned)
        else:
            start, n = self._allocate(need, need + self._headroom(need), pinned)
            self._move(entry.start, start * self.block_size, keep)  # entry.start may have moved
            self._give(entry.start // self.block_size, entry.capacity // self.block_size)
        self.stats.relocations += 1
        entry.start, entry.capacity = start * self.block_size, n * self.block_size

    def _allocate(self, need: int, want: int, pinned: set[int]) -> tuple[int, int]:
        """(first block, count) of a fresh extent of `want` blocks, or else of `need`."""
        compacted = trimmed = False
        while True:
            for n in (want, need):
                start = self._take(n)
                if start is not None:
                    return start, n
            if not trimmed:  # growth room of sequences outside the batch goes first
                trimmed = self._trim(pinned)
                if trimmed:
                    continue
                trimmed = True
            if self._evict_one(pinned, strict=False):
                continue
            if not compacted and sum(n for _, n in self._free) >= need:
                self._compact()
                compacted = True
                continue
            raise PoolFull(f"{need} blocks do not fit beside the {len(pinned)} sequences "
                           "of this batch")

    def _trim(self, pinned: set[int]) -> bool:
        """Give back the unused tail blocks of entries outside `pinned`; whether any were."""
        freed = False
        for cache_id, entry in self._entries.items():
            used = self._blocks(len(entry.token_ids)) if entry.token_ids else 0
            have = entry.capacity // self.block_size
            if cache_id in pinned or not entry.capacity or used >= have:
                continue
            if used == 0:
                entry.capacity = 0
                self._give(entry.start // self.block_size, have)
            else:
                self._give(entry.start // self.block_size + used, have - used)
                entry.capacity = used * self.block_size
            freed = True
        return freed

    def _evict_one(self, pinned: set[int], strict: bool = True) -> bool:
        victim = next((i for i in self._entries if i not in pinned), None)
        if victim is None:
            if strict:
                raise PoolFull(f"max_num_seqs ({self.max_num_seqs}) sequences are in this batch")
            return False
        self._drop(victim)
        self.stats.evictions += 1
        return True

    def _drop(self, cache_id: int) -> bool:
        entry = self._entries.pop(cache_id, None)
        if entry is None:
            return False
        if entry.capacity:
            self._give(entry.start // self.block_size, entry.capacity // self.block_size)
        return True

    # -- the free list -----------------------------------------------------------------------
    def _take(self, n: int) -> int | None:
        """Best fit: the smallest free run of at least n blocks."""
        best = None
        for i, (_, count) in enumerate(self._free):
            if count >= n and (best is None or count < self._free[best][1]):
                best = i
        if best is None:
            return None
        start, count = self._free[best]
        if count == n:
            del self._free[best]
        else:
            self._free[best] = (start + n, count - n)
        return start

    def _give(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, n))
        if i + 1 < len(self._free) and start + n == self._free[i + 1][0]:  # merge right
            self._free[i] = (start, n + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # merge left
            prev_start, prev_n = self._free[i - 1]
            self._free[i - 1] = (prev_start, prev_n + self._free.pop(i)[1])

    def _move(self, src: int, dst: int, n: int) -> None:
        """Copy n token slots (all layers, keys and values) from src to dst."""
        if n and src != dst:
            self.kv.narrow(self.token_dim, dst, n).copy_(
                self.kv.narrow(self.token_dim, src, n).clone())

    def _compact(self) -> None:
        """Slide every extent to the front of the pool, leaving one free run at the end."""
        cursor = 0
        for entry in sorted(self._entries.values(), key=lambda e: e.start):
            if not entry.capacity:
                continue
            if entry.start != cursor * self.block_size:
                self._move(entry.start, cursor * self.block_size, len(entry.token_ids))
                entry.start = cursor * self.block_size
            cursor += entry.capacity // self.block_size
        self._free = [(cursor, self.num_blocks - cursor)] if cursor < self.num_blocks else []
        self.stats.compactions += 1
