"""A health probe for servers that speak TLS (the kubelet's native gRPC probes cannot):

    python -m specdecode.serving.probe --address 127.0.0.1:50053 --tls-ca ca.crt \\
        --tls-cert tls.crt --tls-key tls.key [--service NAME] [--timeout 5]

Exits 0 when grpc.health.v1 reports SERVING, 1 otherwise (printing why). The certificate
is presented to servers that require client certificates (mutual TLS); the server's name
is checked against --server-name (default: the address's host)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdecode.serving.tls import TlsFiles, channel_credentials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdecode.serving.probe", description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--tls-ca")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--server-name", default=None)
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=5.0)
    a = parser.parse_args(argv)
    if a.tls_ca or a.tls_cert:
        options = [("grpc.ssl_target_name_override", a.server_name)] if a.server_name else []
        channel = grpc.secure_channel(a.address, channel_credentials(
            TlsFiles(a.tls_cert, a.tls_key, a.tls_ca)), options=options)
    else:
        channel = grpc.insecure_channel(a.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)
        except grpc.RpcError as exc:
            print(f"{a.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if status != "SERVING":
        print(f"{a.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
