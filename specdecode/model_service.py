"""What the proposer and scorer servicers share: a model loaded from CLI options, its
ModelInfo, request decoding with validation, serialised access to the model, and the
model's Prometheus metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdecode import wire
from specdecode.device import resolve_device, resolve_dtype
from specdecode.model_info import ModelInfo
from specdecode.model_runner import ForwardStats, ModelRunner
from specdecode.models import (default_model_path, has_tokenizer, load_model, load_tokenizer, resolve_model_dir,
                               tokenizer_fingerprint, vocab_fingerprint)
from specdecode.sequence import ExecuteModelRequest, InvalidRequestError
from specdecode.server import Deferred, map_errors
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
    if has_tokenizer(model_dir):
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


class ModelServicer(Deferred):
    """What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, and one
    model call at a time. Serves after attach(info=ModelInfo, <role>=its proposer/scorer)."""

    info: ModelInfo

    def __init__(self):
        self.model = ModelAccess()

    def _core(self):
        """The proposer or scorer this servicer fronts."""
        raise NotImplementedError

    @map_errors
    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self.info)

    @map_errors
    async def ReleaseSequences(self, request, context):
        released = await self.model.run(self._core().release_sequences, list(request.seq_ids))
        return model_info_pb2.ReleaseSequencesResponse(released=released)


def decode_request(m, info: ModelInfo) -> ExecuteModelRequest:
    """Decode and validate the step's batch against this service's model."""
    req = wire.request_from_proto(m, field="request")
    try:
        req.validate(info.vocab_size, info.max_model_len)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"request.{exc.field}", exc.detail) from None
    return req



# -- Prometheus metrics of a served model (proposer and scorer) ------------------------------

FORWARD_SECONDS = prometheus_client.Histogram(
    "specdecode_model_forward_seconds", "Time of one model forward pass.", ["role"],
    buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
FORWARD_BATCH = prometheus_client.Histogram(
    "specdecode_model_forward_batch_size", "Rows (sequences) in one forward pass.", ["role"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
FORWARD_TOKENS = prometheus_client.Histogram(
    "specdecode_model_forward_tokens", "New tokens computed in one forward pass (what the KV "
    "cache did not save).", ["role"], buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384))


class RunnerCollector:
    """Reads a ModelRunner's counters at scrape time: KV cache hits, misses and occupancy,
    tokens computed. (Forward-pass counts and time are the histograms above.)"""

    def __init__(self, runner: ModelRunner, role: str):
        self.runner, self.role = runner, role

    def collect(self):
        stats, labels = self.runner.stats, [self.role]
        families = [
            (CounterMetricFamily, "specdecode_kv_cache_hits", "Rows that reused a cached KV "
             "prefix.", stats.cache_hits),
            (CounterMetricFamily, "specdecode_kv_cache_misses", "Rows computed from scratch "
             "(no cached prefix).", stats.cache_misses),
            (CounterMetricFamily, "specdecode_model_tokens_computed", "Tokens fed to the "
             "model.", stats.tokens_computed),
            (GaugeMetricFamily, "specdecode_kv_cache_sequences", "Sequences with a cached KV "
             "entry.", self.runner.num_cached_sequences),
            (GaugeMetricFamily, "specdecode_kv_cache_capacity_sequences", "Most sequences the "
             "KV cache keeps (least recently used are evicted).",
             self.runner.max_cached_sequences),
        ]
        for cls, name, doc, value in families:
            family = cls(name, doc, labels=["role"])
            family.add_metric(labels, value)
            yield family


_collectors: dict[str, RunnerCollector] = {}


def export_runner_metrics(runner: ModelRunner, role: str,
                          registry=prometheus_client.REGISTRY) -> None:
    """Export `runner`'s metrics under the label role=`role` (proposer | scorer); a later
    call for the same role replaces the earlier runner."""
    old = _collectors.pop(role, None)
    if old is not None:
        registry.unregister(old)
    collector = _collectors[role] = RunnerCollector(runner, role)
    registry.register(collector)
    seconds, batch, tokens = (FORWARD_SECONDS.labels(role), FORWARD_BATCH.labels(role),
                              FORWARD_TOKENS.labels(role))

    def observe(f: ForwardStats) -> None:
        seconds.observe(f.seconds)
        batch.observe(f.batch_size)
        tokens.observe(f.tokens_computed)
    runner.on_forward = observe
