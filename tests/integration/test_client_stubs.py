"""Stubs for the public API generated under another package name (scripts/gen_client_stubs.py)
import beside the installed `specdecode` without shadowing it, and speak the same wire."""

from __future__ import annotations

import os
import subprocess
import sys

from specdecode.v1 import spec_decode_service_pb2 as pb
from tests.support.paths import ROOT


CLIENT = """
import specdecode, specdecode_client.spec_decode_service_pb2 as pb
import specdecode_client.spec_decode_service_pb2_grpc as grpc_stubs
assert specdecode.__file__.startswith({root!r}), specdecode.__file__  # not shadowed
assert hasattr(grpc_stubs, "SpecDecodeServiceStub")
request = pb.GenerateRequest(text="hi", max_tokens=3, logprobs=2, n=2, logit_bias={{7: 1.5}})
print(request.SerializeToString().hex())
"""


def test_generated_stubs_do_not_shadow_and_speak_the_wire(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_client_stubs.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True)
    assert not (tmp_path / "specdecode").exists()
    out = subprocess.run([sys.executable, "-c", CLIENT.format(root=str(ROOT))], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    request = pb.GenerateRequest.FromString(bytes.fromhex(out.stdout.strip()))
    assert (request.text, request.max_tokens, request.logprobs, request.n) == ("hi", 3, 2, 2)
    assert dict(request.logit_bias) == {7: 1.5}

