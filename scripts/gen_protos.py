#!/usr/bin/env python3
"""Regenerate the Python code in specdecode/v1/ from protos/specdecode/v1/*.proto.

    python scripts/gen_protos.py              # rewrite specdecode/v1/ in this checkout
    python scripts/gen_protos.py --out DIR    # write DIR/specdecode/v1/ instead (drift test)

Uses grpc_tools.protoc with the mypy-protobuf plugins from the same environment, so the
output depends only on the pinned grpcio-tools and mypy-protobuf versions. The hand-written
specdecode/v1/__init__.py is left alone.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = "protos"
PACKAGE_DIR = Path("specdecode") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed beside this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install mypy-protobuf")
    return found


def generated_files(out: Path) -> list[Path]:
    """The generated files under out/specdecode/v1, sorted."""
    pkg = out / PACKAGE_DIR
    return sorted(p for p in pkg.glob("*.py*") if p.name.endswith(GENERATED_SUFFIXES))


def _protoc(outputs: list[str], out: Path, protos: list[str]) -> None:
    """Run protoc on `protos` (paths relative to the checkout) with the given output flags."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        *(f"{flag}={out}" for flag in outputs),
        *(str(ROOT / p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generate(out: Path) -> list[Path]:
    """Write the generated modules for every proto into out/specdecode/v1; return them."""
    protos = sorted(p.relative_to(ROOT).as_posix()
                    for p in (ROOT / PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {ROOT / PROTO_ROOT / PACKAGE_DIR}")
    out.mkdir(parents=True, exist_ok=True)
    for stale in generated_files(out):
        stale.unlink()
    # gRPC stubs only for files that define a service (no empty *_pb2_grpc modules).
    services = [p for p in protos if re.search(r"^service\s", (ROOT / p).read_text(), re.M)]
    _protoc(["--python_out", "--mypy_out"], out, protos)
    _protoc(["--grpc_python_out", "--mypy_grpc_out"], out, services)
    return generated_files(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT,
                        help="root to write specdecode/v1/ under (default: the checkout)")
    files = generate(parser.parse_args().out.resolve())
    print(f"wrote {len(files)} files")


if __name__ == "__main__":
    main()
