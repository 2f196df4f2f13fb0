"""Generated protobuf and gRPC modules for the wire contract `specdecode.v1`.

Source of truth: protos/specdecode/v1/*.proto. Do not edit the *_pb2* files here by hand;
regenerate them with `python scripts/gen_protos.py` (tests/integration/test_protos.py fails
when they are stale). Convert to and from the dataclasses with `specdecode.wire`.
"""
