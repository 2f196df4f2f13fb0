"""One real stack the HTTP API's integration tests share (starting one takes a minute on a
busy host): SmolLM2-135M target (it has a chat template), n-gram proposer, three processes
on loopback, `--served-model-name smol`, exporting traces and metrics to a real OTLP
receiver."""

from __future__ import annotations

import pytest

from specdecode_stack.local import LocalStack, StackConfig, free_port
from tests.otlp import Receiver
from tests.support.smol_stack import SERVED


@pytest.fixture(scope="session")
def otlp():
    receiver = Receiver()
    yield receiver
    receiver.server.stop(None)


@pytest.fixture(scope="session")
def smol_stack(otlp):
    config = StackConfig(device="cpu", port=0, http_port=free_port(), served_model_name=SERVED,
                         extra_env=otlp.env)
    with LocalStack(config) as s:
        yield s
