"""Lossless verification of proposals: vLLM 0.4.2's RejectionSampler, with ragged proposal lengths.

Row i of a batch proposes n_i tokens: the leading entries of `draft_token_ids[i]` that are not -1.
Position j < n_i accepts the draft token x with probability min(1, p_j(x) / q_j(x)); the first
rejected position emits a token drawn from normalize(max(0, p_j - q_j)) instead; if all n_i are
accepted, the bonus token (drawn by the target model from p_{n_i}) follows. The emitted tokens are
then distributed exactly as the target model's own samples. Output rows are [k+1] long, -1 padded.

Rows with n_i = 0 are not speculative and belong on the non-speculative path. In strict mode they
raise; otherwise they emit just their bonus token.

The sampler keeps no state: each call returns the emitted tokens and, per row, how many draft
tokens passed the accept test. Counting them into metrics is the engine's step stats' job
(orchestrator.engine.core.StepStats), as in vLLM v1, where metrics live outside the sampler.
"""

from __future__ import annotations

import torch

from specdecode.errors import InvalidRequestError

Generators = list[torch.Generator | None] | None


def proposal_lengths(draft_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, k] long -> (n [B] long, proposed [B, k] bool): positions before the first -1."""
    proposed = (draft_token_ids != -1).long().cumprod(dim=1)  # [B, k] 1 up to the first -1
    return proposed.sum(dim=1), proposed.bool()


def _emit(draft_token_ids: torch.Tensor, accepted: torch.Tensor,
          next_token: torch.Tensor) -> torch.Tensor:
    """The accepted prefix of each row, then next_token at the prefix's end, then -1.

    draft_token_ids [B, k], accepted [B, k] bool (False where not proposed),
    next_token [B, k+1]: what to emit if the prefix ends at that position.
    Returns output [B, k+1] long.
    """
    prefix = accepted.long().cumprod(dim=1).bool()  # [B, k] accepted and all before it too
    end = prefix.sum(dim=1, keepdim=True)  # [B, 1] length of the accepted prefix
    out = torch.full_like(next_token, -1)  # [B, k+1]
    out[:, :-1] = torch.where(prefix, draft_token_ids, -1)
    out.scatter_(1, end, next_token.gather(1, end))
    return out


def _draw(residual: torch.Tensor, proposed: torch.Tensor, lengths: list[int],
          generators: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms and one recovered token per position: (u [B, k], recovered [B, k] long).

    residual [B, k, V] non-negative, unnormalised. Rows without a generator draw together from
    the global RNG, and only they do (as in vLLM): seeded batch mates take nothing from it. A
    row with a generator draws n_i uniforms, then n_i tokens, from it alone, so its output does
    not depend on its batch mates. Values at unproposed positions are unused.
    """
    B, k, V = residual.shape
    gens = generators or [None] * B
    u = torch.ones(B, k, device=residual.device)
    recovered = torch.zeros(B, k, dtype=torch.long, device=residual.device)
    unseeded = [i for i, g in enumerate(gens) if g is None]
    if unseeded:
        rows = torch.tensor(unseeded, device=residual.device)
        u[rows] = torch.rand(len(unseeded), k, device=residual.device)
        valid = torch.where(proposed[rows].unsqueeze(-1), residual[rows], 1.0)  # no empty rows
        recovered[rows] = torch.multinomial(valid.view(-1, V), 1).view(len(unseeded), k)
    for i, g in enumerate(gens):
        n = lengths[i]
        if g is not None and n:
            u[i, :n] = torch.rand(n, device=residual.device, generator=g)
            recovered[i, :n] = torch.multinomial(residual[i, :n], 1, generator=g).squeeze(1)
    return u, recovered


Verified = tuple[torch.Tensor, torch.Tensor]


class RejectionSampler:
    """Verifies a batch of proposals. Both methods return (token_ids, accepted):

    token_ids [B, k+1] long: the accepted prefix, then the recovered or bonus token, then -1.
    accepted [B] long: draft tokens that passed the accept test, whether or not the prefix
    before them did (vLLM 0.4.2's accepted_tokens: an alignment measure, not what users see;
    what users see is the prefix, i.e. the row's emitted tokens minus one).
    """

    def __init__(self, strict_mode: bool = False):
        self.strict_mode = strict_mode

    def __call__(self, target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                 draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor, *,
                 generators: Generators = None) -> Verified:
        """Rejection-sample a batch: (token_ids [B, k+1], accepted [B]) as above.

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
        return _emit(draft_token_ids, accepted, next_token), accepted.sum(dim=1)

    def greedy(self, target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor) -> Verified:
        """Greedy verification: accept while draft == target; then the target's token.

        target_token_ids [B, k+1] long (the target's argmax at each position; k+1 = bonus),
        draft_token_ids [B, k] long, -1 after n_i. Returns (token_ids [B, k+1], accepted [B]).
        """
        if self.strict_mode:
            _check_greedy_inputs(target_token_ids, draft_token_ids)
        _, proposed = proposal_lengths(draft_token_ids)
        accepted = (draft_token_ids == target_token_ids[:, :-1]) & proposed  # [B, k]
        return _emit(draft_token_ids, accepted, target_token_ids), accepted.sum(dim=1)


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
