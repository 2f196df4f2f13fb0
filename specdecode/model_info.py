"""What a service says about its model, and the check that a draft/target pair can work
together (docs/design.md, invariant 4: compatibility is checked, not assumed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # cost_model loads torch; the command line's client path must not
    from specdecode.cost_model import ForwardCosts


NGRAM = "ngram"  # the proposer model name (and --model value) of prompt-lookup proposals


class IncompatibleModelsError(ValueError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_model_len: int
    device: str = "cpu"
    dtype: str = "float32"
    role: str = ""  # "proposer" | "scorer"
    scoring_method: str = ""  # scorer only: batch-expansion | multi-query | auto
    forward_cost: ForwardCosts | None = None  # measured; None for the n-gram proposer
    structured_output: bool = False  # builds grammar masks (has the model's tokenizer)

    @property
    def is_draft_model(self) -> bool:
        """A proposer that runs a model (n-gram reports vocab_size 0: no forward, no KV)."""
        return self.vocab_size > 0


def check_compatible(proposer: ModelInfo, scorer: ModelInfo) -> None:
    """Raise IncompatibleModelsError naming both values of every field that disagrees.

    A draft model must share the target's vocabulary and tokenizer. An n-gram proposer
    reports vocab_size 0: it proposes ids taken from the sequences themselves, so any
    vocabulary fits.
    """
    if not proposer.is_draft_model:
        return
    problems = [
        f"{name}: proposer {getattr(proposer, name)!r} != scorer {getattr(scorer, name)!r}"
        for name in ("vocab_size", "tokenizer_fingerprint")
        if getattr(proposer, name) != getattr(scorer, name)]
    if problems:
        raise IncompatibleModelsError(
            f"proposer {proposer.model_name!r} and scorer {scorer.model_name!r} cannot be paired: "
            + "; ".join(problems))


def check_tokenizer(fingerprint: str, scorer: ModelInfo) -> None:
    """The orchestrator's tokenizer must be the scorer's: else text and ids disagree."""
    if fingerprint != scorer.tokenizer_fingerprint:
        raise IncompatibleModelsError(
            f"the orchestrator's tokenizer (fingerprint {fingerprint[:12]}) is not the scorer's "
            f"(model {scorer.model_name!r}, fingerprint {scorer.tokenizer_fingerprint[:12]}); "
            "pass --tokenizer with the target model's path, or 'none' for token ids only")


def serving_max_model_len(proposer: ModelInfo, scorer: ModelInfo) -> int:
    """Sequences may grow to the shorter of the two models' limits."""
    return min(proposer.max_model_len, scorer.max_model_len)
