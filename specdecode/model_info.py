"""What a service says about its model, and the check that a draft/target pair can work
together (docs/design.md, invariant 4: compatibility is checked, not assumed)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # cost_model loads torch; the command line's client path must not
    from specdecode.cost_model import ForwardCosts


NGRAM = "ngram"  # the proposer model name (and --model value) of prompt-lookup proposals


class IncompatibleModelsError(ValueError):
    pass


def host_id() -> str:
    """This host's boot id (the same in every container on it), else its name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cpus() -> tuple[int, ...]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


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
    # Where the service runs (this process, where it is built): its host and CPU cores.
    host_id: str = field(default_factory=host_id)
    cpus: tuple[int, ...] = field(default_factory=cpus)

    @property
    def is_draft_model(self) -> bool:
        """A proposer that runs a model (n-gram reports vocab_size 0: no forward, no KV)."""
        return self.vocab_size > 0


def share_cores(a: ModelInfo, b: ModelInfo) -> bool:
    """Whether two services' forwards compete for the same CPU cores: both on the CPU of
    one host with a core in common (unknown placement counts as shared)."""
    if a.device != "cpu" and b.device != "cpu":
        return False
    if not (a.host_id and b.host_id and a.cpus and b.cpus):
        return True
    return a.host_id == b.host_id and bool(set(a.cpus) & set(b.cpus))


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
