"""What the proposer and scorer servicers share: a model loaded from CLI options, its
ModelInfo, request decoding with validation, and serialised access to the model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from specdecode import wire
from specdecode.device import resolve_device, resolve_dtype
from specdecode.model_info import ModelInfo
from specdecode.model_runner import ModelRunner
from specdecode.models import (default_model_path, load_model, load_tokenizer, resolve_model_dir,
                               tokenizer_fingerprint, vocab_fingerprint)
from specdecode.sequence import ExecuteModelRequest, InvalidRequestError
from specdecode.v1 import model_info_pb2


@dataclass(frozen=True)
class ModelOptions:
    model: str | None  # directory, .gguf file, None = the default model
    device: str = "auto"
    dtype: str = "float32"
    max_model_len: int | None = None


def load_runner(options: ModelOptions) -> tuple[ModelRunner, str]:
    """The model runner and the tokenizer fingerprint (vocabulary-only when the model
    directory has no tokenizer, as with test models)."""
    device = resolve_device(options.device)
    model_dir = resolve_model_dir(options.model)
    model = load_model(model_dir, device, resolve_dtype(options.dtype))
    runner = ModelRunner(model, device, options.max_model_len)
    if any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        fingerprint = tokenizer_fingerprint(load_tokenizer(model_dir))
    else:
        fingerprint = vocab_fingerprint(runner.vocab_size)
    return runner, fingerprint


def model_info_for(runner: ModelRunner, options: ModelOptions, fingerprint: str, role: str,
                   scoring_method: str = "") -> ModelInfo:
    name = Path(options.model).name if options.model not in (None, "", "default") else \
        default_model_path().name
    return ModelInfo(model_name=name, vocab_size=runner.vocab_size,
                     tokenizer_fingerprint=fingerprint, max_model_len=runner.max_model_len,
                     device=str(runner.device), dtype=str(runner.model.dtype).removeprefix("torch."),
                     role=role, scoring_method=scoring_method)


def model_info_to_proto(info: ModelInfo) -> model_info_pb2.ModelInfo:
    return model_info_pb2.ModelInfo(**vars(info))


def model_info_from_proto(m: model_info_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(**{f: getattr(m, f) for f in ModelInfo.__dataclass_fields__})


class ModelAccess:
    """One model call at a time, off the event loop."""

    def __init__(self):
        self._lock = asyncio.Lock()

    async def run(self, fn, *args):
        async with self._lock:
            return await asyncio.to_thread(fn, *args)


def decode_request(m, info: ModelInfo) -> ExecuteModelRequest:
    """Decode and validate the step's batch against this service's model."""
    req = wire.request_from_proto(m, field="request")
    try:
        req.validate(info.vocab_size, info.max_model_len)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"request.{exc.field}", exc.detail) from None
    return req

