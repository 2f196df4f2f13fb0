"""Fixtures shared by the unit and integration tests: the tiny random Llama pair (one
vocabulary), saved as model directories for service processes, long-context twins of it,
and an in-memory span exporter. Helpers are in tests/support/."""

from __future__ import annotations

import dataclasses

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
from tests.support.models import DRAFT, TARGET

LONG_CONTEXT = 8192


@pytest.fixture(scope="session")
def target_model():
    return build_tiny_model(TARGET)


@pytest.fixture(scope="session")
def draft_model():
    return build_tiny_model(DRAFT)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, target_model, draft_model):
    """The tiny target and draft saved as safetensors directories, for service processes,
    plus a draft whose vocabulary does not match (for the compatibility check)."""
    root = tmp_path_factory.mktemp("models")
    dirs = {"target": root / "target", "draft": root / "draft", "bad_draft": root / "bad"}
    target_model.save_pretrained(dirs["target"])
    draft_model.save_pretrained(dirs["draft"])
    build_tiny_model(TinyModelSpec(seed=3, vocab_size=300, num_layers=1)).save_pretrained(
        dirs["bad_draft"])
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="session")
def long_models(tmp_path_factory):
    """The tiny pair with an 8,192-token context (chunked prefill), as models and saved."""
    root = tmp_path_factory.mktemp("long")
    target = build_tiny_model(dataclasses.replace(TARGET, max_position_embeddings=LONG_CONTEXT))
    draft = build_tiny_model(dataclasses.replace(DRAFT, max_position_embeddings=LONG_CONTEXT))
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return target, draft, {"target": str(root / "target"), "draft": str(root / "draft")}


@pytest.fixture
def exporter():
    """A global SDK provider with an in-memory exporter, restored afterwards (the API lets a
    process set its provider once; tests reset that guard)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace.set_tracer_provider(provider)
    try:
        yield memory
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
        provider.shutdown()
