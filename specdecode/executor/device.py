"""Device and dtype selection: cpu, cuda or an Ascend npu (torch_npu, imported lazily).

The choices are plain names and torch is imported only by the functions that need it, so
the command line offers them without loading torch (`specdecode generate` never does).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


class DeviceUnavailableError(RuntimeError):
    pass


def _npu_available() -> bool:
    """True when torch_npu imports and reports a device. Never raises."""
    import torch
    try:
        importlib.import_module("torch_npu")
    except Exception:  # ImportError, or CANN libraries missing at import time
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_device(name: str) -> torch.device:
    """Map --device to a torch.device; 'auto' prefers npu, then cuda, then cpu."""
    import torch
    if name not in DEVICE_CHOICES:
        raise ValueError(f"device: must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "auto":
        if _npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError("device cuda: torch.cuda.is_available() is False on this host")
    if name == "npu":
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:
            raise DeviceUnavailableError(
                "device npu: cannot import torch_npu (install specdecode[npu] and the Ascend "
                f"CANN toolkit, then source its set_env.sh): {exc}") from exc
        if not torch.npu.is_available():
            raise DeviceUnavailableError("device npu: torch_npu imported but no NPU is visible")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    import torch
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return getattr(torch, name)


def backend(device: torch.device):
    """The torch backend module (torch.cuda, torch.npu) owning streams and events of `device`,
    or None for cpu, where copies are synchronous."""
    import torch
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None:
        raise DeviceUnavailableError(f"device {device.type}: torch has no backend module for it")
    return module
