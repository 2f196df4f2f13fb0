"""Device and dtype selection (specdecode/executor/device.py) without the optional backends."""

from __future__ import annotations

import pytest
import torch

from specdecode.executor.device import DeviceUnavailableError, resolve_device, resolve_dtype


def test_device_selection():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda", "npu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(DeviceUnavailableError, match="torch_npu"):
        resolve_device("npu")  # torch_npu is an optional extra, absent here
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="cuda"):
            resolve_device("cuda")
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8")
