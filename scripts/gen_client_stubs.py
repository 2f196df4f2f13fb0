#!/usr/bin/env python3
"""Generate Python stubs for the public API (SpecDecodeService) under a package name of
your choice, so they cannot shadow the `specdecode` package.

    python scripts/gen_client_stubs.py --out DIR [--package specdecode_client]

writes DIR/<package>/ with spec_decode_service_pb2{,_grpc}.py, model_info_pb2.py and
structured_output_pb2.py (what the public service imports), their imports rewritten to
`<package>`. Plain protoc output would be a `specdecode/v1/` tree that, on sys.path, hides
the installed `specdecode` package. The wire is unchanged (the proto package stays
`specdecode.v1`); don't import these stubs and `specdecode.v1` in one process (both
register the same proto files).
Needs grpcio-tools. Inside this project, use `specdecode.v1` directly.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = ["specdecode/v1/spec_decode_service.proto", "specdecode/v1/model_info.proto",
          "specdecode/v1/structured_output.proto"]


def generate(out: Path, package: str) -> list[Path]:
    from grpc_tools import protoc

    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", package) or package == "specdecode":
        raise SystemExit(f"--package: a Python identifier other than 'specdecode', got {package!r}")
    target = out / package
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", *(str(ROOT / "protos" / p) for p in PUBLIC)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for src in sorted((Path(tmp) / "specdecode" / "v1").glob("*.py")):
            text = src.read_text().replace("from specdecode.v1 import", f"from {package} import")
            dst = target / src.name
            dst.write_text(text)
            written.append(dst)
    (target / "__init__.py").write_text(
        '"""Generated stubs for specdecode\'s public gRPC API (scripts/gen_client_stubs.py)."""\n')
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    parser.add_argument("--package", default="specdecode_client",
                        help="the stubs' Python package name")
    args = parser.parse_args()
    files = generate(args.out.resolve(), args.package)
    print(f"wrote {len(files)} modules under {args.out / args.package}")


if __name__ == "__main__":
    main()
