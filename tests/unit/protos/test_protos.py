"""The wire contract in protos/: every element is documented, and enum zero values are
*_UNSPECIFIED."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from google.protobuf import descriptor_pb2

from tests.support.paths import ROOT

PROTO_DIR = ROOT / "protos" / "specdecode" / "v1"


def _descriptors(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    out = tmp_path / "descriptors.pb"
    protos = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    assert protos
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", "--include_source_info",
                      f"--descriptor_set_out={out}", *protos])
    assert rc == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _elements(f: descriptor_pb2.FileDescriptorProto) -> Iterator[tuple[tuple[int, ...], str]]:
    """(source-info path, name) of every documentable element of a file."""
    F = descriptor_pb2.FileDescriptorProto
    D = descriptor_pb2.DescriptorProto
    E = descriptor_pb2.EnumDescriptorProto
    S = descriptor_pb2.ServiceDescriptorProto

    def enum(path: tuple[int, ...], e: descriptor_pb2.EnumDescriptorProto, scope: str):
        yield path, f"enum {scope}{e.name}"
        for i, v in enumerate(e.value):
            yield (*path, E.VALUE_FIELD_NUMBER, i), f"enum value {scope}{e.name}.{v.name}"

    def message(path: tuple[int, ...], m: descriptor_pb2.DescriptorProto, scope: str):
        name = f"{scope}{m.name}"
        if m.options.map_entry:
            return
        yield path, f"message {name}"
        for i, fld in enumerate(m.field):
            yield (*path, D.FIELD_FIELD_NUMBER, i), f"field {name}.{fld.name}"
        for i, o in enumerate(m.oneof_decl):
            if not o.name.startswith("_"):  # synthetic oneof of a proto3 `optional`
                yield (*path, D.ONEOF_DECL_FIELD_NUMBER, i), f"oneof {name}.{o.name}"
        for i, n in enumerate(m.nested_type):
            yield from message((*path, D.NESTED_TYPE_FIELD_NUMBER, i), n, f"{name}.")
        for i, e in enumerate(m.enum_type):
            yield from enum((*path, D.ENUM_TYPE_FIELD_NUMBER, i), e, f"{name}.")

    for i, m in enumerate(f.message_type):
        yield from message((F.MESSAGE_TYPE_FIELD_NUMBER, i), m, "")
    for i, e in enumerate(f.enum_type):
        yield from enum((F.ENUM_TYPE_FIELD_NUMBER, i), e, "")
    for i, s in enumerate(f.service):
        yield (F.SERVICE_FIELD_NUMBER, i), f"service {s.name}"
        for j, rpc in enumerate(s.method):
            yield (F.SERVICE_FIELD_NUMBER, i, S.METHOD_FIELD_NUMBER, j), f"rpc {s.name}.{rpc.name}"


def test_every_element_has_a_leading_comment(tmp_path: Path) -> None:
    files = _descriptors(tmp_path).file
    assert {f.package for f in files} == {"specdecode.v1"}
    missing, seen = [], 0
    for f in files:
        comments = {tuple(loc.path): loc.leading_comments.strip()
                    for loc in f.source_code_info.location}
        for path, what in _elements(f):
            seen += 1
            if not comments.get(path):
                missing.append(f"{f.name}: {what}")
    assert seen > 100
    assert not missing, "add a leading // comment to:\n" + "\n".join(missing)


def test_enum_zero_values_are_unspecified(tmp_path: Path) -> None:
    for f in _descriptors(tmp_path).file:
        for e in f.enum_type:
            assert e.value[0].number == 0 and e.value[0].name.endswith("_UNSPECIFIED"), e.name
