"""Lossless verification of proposals: vLLM 0.4.2's RejectionSampler, with ragged proposal lengths.

Row i of a batch proposes n_i tokens: the leading entries of `draft_token_ids[i]` that are not -1.
Position j < n_i accepts the draft token x with probability min(1, p_j(x) / q_j(x)); the first
rejected position emits a token drawn from normalize(max(0, p_j - q_j)) instead; if all n_i are
accepted, the bonus token (drawn by the target model from p_{n_i}) follows. The emitted tokens are
then distributed exactly as the target model's own samples. Output rows are [k+1] long, -1 padded.

Rows with n_i = 0 are not speculative and belong on the non-speculative path. In strict mode they
raise; otherwise they emit just their bonus token and still count as a speculated sequence in
`num_spec_sequences`, which lowers `system_efficiency`.
"""

from __future__ import annotations

import torch

from specdecode.sequence import InvalidRequestError

Generators = list[torch.Generator | None] | None


def proposal_lengths(draft_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, k] long -> (n [B] long, proposed [B, k] bool): positions before the first -1."""
    proposed = (draft_token_ids != -1).long().cumprod(dim=1)  # [B, k] 1 up to the first -1
    return proposed.sum(dim=1), proposed.bool()


def _emit(draft_token_ids: torch.Tensor, accepted: torch.Tensor,
          next_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted prefix of each row, then next_token at the prefix's end, then -1.

    draft_token_ids [B, k], accepted [B, k] bool (False where not proposed),
    next_token [B, k+1]: what to emit if the prefix ends at that position.
    Returns (output [B, k+1] long, prefix [B, k] bool).
    """
    prefix = accepted.long().cumprod(dim=1).bool()  # [B, k] accepted and all before it too
    end = prefix.sum(dim=1, keepdim=True)  # [B, 1] length of the accepted prefix
    out = torch.full_like(next_token, -1)  # [B, k+1]
    out[:, :-1] = torch.where(prefix, draft_token_ids, -1)
    out.scatter_(1, end, next_token.gather(1, end))
    return out, prefix


def _draw(residual: torch.Tensor, proposed: torch.Tensor, lengths: list[int],
          generators: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms and one recovered token per position: (u [B, k], recovered [B, k] long).

    residual [B, k, V] non-negative, unnormalised. Rows without a generator draw together from
    the global RNG. A row with a generator draws n_i uniforms, then n_i tokens, from it alone,
    so its output does not depend on its batch mates. Values at unproposed positions are unused.
    """
    B, k, V = residual.shape
    if generators is None or any(g is None for g in generators):
        u = torch.rand(B, k, device=residual.device)
        valid = torch.where(proposed.unsqueeze(-1), residual, 1.0)  # [B, k, V] no empty rows
        recovered = torch.multinomial(valid.view(B * k, V), 1).view(B, k)
    else:
        u = torch.ones(B, k, device=residual.device)
        recovered = torch.zeros(B, k, dtype=torch.long, device=residual.device)
    for i, g in enumerate(generators or []):
        n = lengths[i]
        if g is not None and n:
            u[i, :n] = torch.rand(n, device=residual.device, generator=g)
            recovered[i, :n] = torch.multinomial(residual[i, :n], 1, generator=g).squeeze(1)
    return u, recovered


class RejectionSampler:
    """Verifies a batch of proposals; keeps the acceptance counters the metrics collector reads.

    Counters: `num_accepted_tokens`, `num_emitted_tokens` (long scalar tensors on `device`, updated
    in place, so reading them never syncs a step) and `accepted_per_position` ([k_max_seen] long
    on `device`: how often position j was emitted as an accepted draft token); `num_draft_tokens`
    and `num_spec_sequences` are Python ints.
    """

    def __init__(self, strict_mode: bool = False, *, device: torch.device | str = "cpu"):
        self.strict_mode = strict_mode
        self.device = torch.device(device)
        # Draft tokens that passed the accept test, whether or not the prefix before them did
        # (the seed's NOTE on accepted_tokens: an alignment measure, not what users see).
        self.num_accepted_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        # Tokens emitted: accepted prefix + the recovered or bonus token.
        self.num_emitted_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self.num_draft_tokens = 0  # sum of n_i
        self.num_spec_sequences = 0  # rows verified
        self.accepted_per_position = torch.zeros(0, dtype=torch.long, device=self.device)
        # Per row of the last call: draft tokens that passed the accept test ([B] long, host).
        self.last_accepted_counts = torch.zeros(0, dtype=torch.long)

    def __call__(self, target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                 draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor, *,
                 generators: Generators = None) -> torch.Tensor:
        """Rejection-sample a batch. Returns [B, k+1] long, -1 after each row's last token.

        target_probs [B, k, V] float32: p at each proposal position.
        bonus_token_ids [B, 1] long: drawn from p at position n_i, emitted if all n_i accepted.
        draft_probs [B, k, V] float32, or None: each draft token is then a point mass.
        draft_token_ids [B, k] long, -1 after row i's n_i proposals.
        generators: one per row (None = the global RNG) for the uniforms and recovered tokens.
        """
        if self.strict_mode:
            _check_sample_inputs(target_probs, bonus_token_ids, draft_probs, draft_token_ids,
                                 generators)
        n, proposed = proposal_lengths(draft_token_ids)  # [B], [B, k]
        ids = draft_token_ids.clamp(min=0).unsqueeze(-1)  # [B, k, 1] (-1 -> 0, masked later)
        p_x = target_probs.gather(-1, ids).squeeze(-1)  # [B, k]
        if draft_probs is None:  # q = one-hot(x): accept with prob p(x), residual = p without x
            q_x = torch.ones_like(p_x)
            residual = target_probs.scatter(-1, ids, 0.0)
        else:
            q_x = draft_probs.gather(-1, ids).squeeze(-1)
            residual = (target_probs - draft_probs).clamp(min=0)  # [B, k, V]
        # p == q leaves nothing to recover from; rejection then has probability 0, but keep p.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs)
        lengths = n.tolist()
        u, recovered = _draw(residual, proposed, lengths, generators)  # [B, k], [B, k]
        accepted = (u * q_x < p_x) & proposed  # u < p/q without dividing by q
        k = draft_token_ids.shape[1]
        bonus = bonus_token_ids.expand(-1, k + 1)  # [B, k+1]
        next_token = torch.cat([recovered, bonus_token_ids], dim=1)  # [B, k+1]
        positions = torch.arange(k + 1, device=n.device)
        next_token = torch.where(positions < n.unsqueeze(1), next_token, bonus)
        out, prefix = _emit(draft_token_ids, accepted, next_token)
        self._count(accepted, out, prefix, lengths)
        return out

    def greedy(self, target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor) -> torch.Tensor:
        """Greedy verification: accept while draft == target; then the target's token.

        target_token_ids [B, k+1] long (the target's argmax at each position; k+1 = bonus),
        draft_token_ids [B, k] long, -1 after n_i. Returns [B, k+1] long, -1 padded.
        """
        if self.strict_mode:
            _check_greedy_inputs(target_token_ids, draft_token_ids)
        n, proposed = proposal_lengths(draft_token_ids)
        accepted = (draft_token_ids == target_token_ids[:, :-1]) & proposed  # [B, k]
        out, prefix = _emit(draft_token_ids, accepted, target_token_ids)
        self._count(accepted, out, prefix, n.tolist())
        return out

    def _count(self, accepted: torch.Tensor, out: torch.Tensor, prefix: torch.Tensor,
               lengths: list[int]) -> None:
        self.last_accepted_counts = accepted.sum(dim=1).cpu()
        self.num_accepted_tokens += accepted.sum().to(self.device)
        self.num_emitted_tokens += (out != -1).sum().to(self.device)
        self.num_draft_tokens += sum(lengths)
        self.num_spec_sequences += len(lengths)
        k = prefix.shape[1]
        if k > self.accepted_per_position.numel():  # grow, keeping the counts so far
            grown = torch.zeros(k, dtype=torch.long, device=self.device)
            grown[:self.accepted_per_position.numel()] = self.accepted_per_position
            self.accepted_per_position = grown
        self.accepted_per_position[:k] += prefix.sum(dim=0).to(self.device)


# --- strict-mode input checks: each raises InvalidRequestError (a ValueError) naming the argument.

def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(name, message)


def _rows(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()[:8]


def _check_draft_ids(draft_token_ids: torch.Tensor, name: str = "draft_token_ids") -> torch.Tensor:
    """Shape, dtype and ragged layout of [B, k] draft ids; returns `proposed` [B, k] bool."""
    _require(isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.dim() == 2,
             name, "must be a [B, k] tensor")
    _require(draft_token_ids.dtype == torch.long, name,
             f"must be int64 (long), got {draft_token_ids.dtype}")
    _require(draft_token_ids.shape[1] >= 1, name, "k must be >= 1")
    n, proposed = proposal_lengths(draft_token_ids)
    _require(not (proposed != (draft_token_ids != -1)).any(), name,
             f"a -1 is followed by a proposed token in rows {_rows((proposed != (draft_token_ids != -1)).any(1))}")
    _require(not (n == 0).any(), name,
             f"rows {_rows(n == 0)} propose no token (n_i = 0); score them non-speculatively")
    return proposed


def _check_probs(probs: torch.Tensor, proposed: torch.Tensor, name: str) -> None:
    _require(probs.is_floating_point(), name, f"must be a float tensor, got {probs.dtype}")
    _require(not ((probs < 0) | (probs > 1) | probs.isnan()).any(), name,
             "values must be probabilities in [0, 1]")
    bad = ((probs.sum(-1) - 1).abs() > 1e-3) & proposed  # [B, k]
    _require(not bad.any(), name,
             f"rows at proposed positions must sum to 1; (row, position) {bad.nonzero()[:4].tolist()} do not")


def _check_sample_inputs(target_probs, bonus_token_ids, draft_probs, draft_token_ids,
                         generators) -> None:
    proposed = _check_draft_ids(draft_token_ids)
    B, k = draft_token_ids.shape
    _require(isinstance(target_probs, torch.Tensor) and target_probs.dim() == 3
             and tuple(target_probs.shape[:2]) == (B, k), "target_probs",
             f"must be [B, k, V] = [{B}, {k}, V] to match draft_token_ids, "
             f"got {tuple(getattr(target_probs, 'shape', ()))}")
    V = target_probs.shape[2]
    _check_probs(target_probs, proposed, "target_probs")
    if draft_probs is not None:
        _require(isinstance(draft_probs, torch.Tensor)
                 and tuple(draft_probs.shape) == tuple(target_probs.shape), "draft_probs",
                 f"must be [B, k, V] = {list(target_probs.shape)} like target_probs, "
                 f"got {list(getattr(draft_probs, 'shape', ()))}")
        _check_probs(draft_probs, proposed, "draft_probs")
    _require(not (proposed & ((draft_token_ids < 0) | (draft_token_ids >= V))).any(),
             "draft_token_ids", f"proposed ids must be in [0, {V})")
    _require(isinstance(bonus_token_ids, torch.Tensor)
             and tuple(bonus_token_ids.shape) == (B, 1), "bonus_token_ids",
             f"must be [B, 1] = [{B}, 1], got {list(getattr(bonus_token_ids, 'shape', ()))}")
    _require(bonus_token_ids.dtype == torch.long, "bonus_token_ids",
             f"must be int64 (long), got {bonus_token_ids.dtype}")
    _require(not ((bonus_token_ids < 0) | (bonus_token_ids >= V)).any(), "bonus_token_ids",
             f"ids must be in [0, {V})")
    _require(generators is None or len(generators) == B, "generators",
             f"must hold one entry (or None) per row: {B}, got {len(generators or [])}")


def _check_greedy_inputs(target_token_ids, draft_token_ids) -> None:
    proposed = _check_draft_ids(draft_token_ids)
    B, k = draft_token_ids.shape
    _require(not (proposed & (draft_token_ids < 0)).any(), "draft_token_ids",
             "proposed ids must be >= 0 (-1 pads)")
    _require(isinstance(target_token_ids, torch.Tensor)
             and tuple(target_token_ids.shape) == (B, k + 1), "target_token_ids",
             f"must be [B, k+1] = [{B}, {k + 1}], got {list(getattr(target_token_ids, 'shape', ()))}")
    _require(target_token_ids.dtype == torch.long, "target_token_ids",
             f"must be int64 (long), got {target_token_ids.dtype}")
    scored = torch.cat([torch.ones_like(proposed[:, :1]), proposed], dim=1)  # positions <= n_i
    _require(not (scored & (target_token_ids < 0)).any(), "target_token_ids",
             "ids at positions 0..n_i must be >= 0")
