"""A served model: loaded from command-line options into a ModelRunner, and described as a
ModelInfo (what GetModelInfo answers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.executor.calibration import CALIBRATION_WIDTH
from specdecode.executor.compile_mode import compile_plan
from specdecode.cost_model import ForwardCosts
from specdecode.executor.device import resolve_device, resolve_dtype
from specdecode.grammar.compiler import GrammarCompiler
from specdecode.grammar.matcher import Grammars
from specdecode.model_info import ModelInfo
from specdecode.executor.model_runner import DEFAULT_MAX_NUM_SEQS, ModelRunner
from specdecode.models.checkpoints import (default_model_path, has_tokenizer, load_model,
                                           load_tokenizer, resolve_model_dir, tokenizer_fingerprint,
                                           vocab_fingerprint)


@dataclass(frozen=True)
class ModelOptions:
    model: str | None  # directory, .gguf file, None = the default model
    device: str = "auto"
    dtype: str = "float32"
    max_model_len: int | None = None
    kv_cache_memory: int | None = None  # bytes; None = the runner's default budget
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    compile: str = "auto"  # specdecode.executor.compile_mode: auto | on | off
    deterministic: bool = False  # row-invariant numerics (specdecode.executor.invariant_ops)
    # The widest forward (query tokens per row) the cost table times: the orchestrator's
    # max k + 1 (specdecode.cost_model).
    calibration_width: int = CALIBRATION_WIDTH
    compile_cache: str | None = None  # inductor's cache directory (TORCHINDUCTOR_CACHE_DIR)
    cost_cache: str | None = None  # where the forward-cost table is kept (executor.cost_cache)


def resolve_deterministic(mode: str, dtype: str) -> bool:
    """--deterministic on|off|auto: auto is on where a row's rounding flips tokens (bfloat16,
    float16) and off in float32, where the fast kernels keep greedy output (invariant 1) and
    the mode would only cost (docs/design.md, Invariant numerics)."""
    return mode == "on" or (mode == "auto" and dtype != "float32")


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '1e9', '1000000' -> bytes."""
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a size (bytes, or a number with KiB, MiB, GiB, "
                         "KB, MB, GB)") from None
    if value < 1:
        raise ValueError(f"{text!r}: must be positive")
    return int(value)


def load_runner(options: ModelOptions) -> tuple[ModelRunner, str]:
    """The model runner and the tokenizer fingerprint (vocabulary-only when the model
    directory has no tokenizer, as with test models)."""
    device = resolve_device(options.device)
    model_dir = resolve_model_dir(options.model)
    model = load_model(model_dir, device, resolve_dtype(options.dtype))
    plan = compile_plan(options.compile, device, options.compile_cache)
    runner = ModelRunner(model, device, options.max_model_len, options.kv_cache_memory,
                         options.max_num_seqs, enforce_eager=plan.enforce_eager,
                         deterministic=options.deterministic, compile_now=plan.compile_now)
    if has_tokenizer(model_dir):
        fingerprint = tokenizer_fingerprint(load_tokenizer(model_dir))
    else:
        fingerprint = vocab_fingerprint(runner.vocab_size)
    return runner, fingerprint


def load_grammars(options: ModelOptions, vocab_size: int, max_sequences: int) -> Grammars | None:
    """The grammar states of a service's constrained sequences, built with the model's
    tokenizer; None when the model has none (test models: no structured output)."""
    model_dir = resolve_model_dir(options.model)
    if not has_tokenizer(model_dir):
        return None
    return Grammars(GrammarCompiler(load_tokenizer(model_dir), vocab_size), max_sequences)


def model_info_for(runner: ModelRunner, options: ModelOptions, fingerprint: str, role: str,
                   scoring_method: str = "", forward_cost: ForwardCosts | None = None,
                   structured_output: bool = False) -> ModelInfo:
    name = Path(options.model).name if options.model not in (None, "", "default") else \
        default_model_path().name
    return ModelInfo(model_name=name, vocab_size=runner.vocab_size,
                     tokenizer_fingerprint=fingerprint, max_model_len=runner.max_model_len,
                     device=str(runner.device), dtype=str(runner.model.dtype).removeprefix("torch."),
                     role=role, scoring_method=scoring_method, forward_cost=forward_cost,
                     structured_output=structured_output)
