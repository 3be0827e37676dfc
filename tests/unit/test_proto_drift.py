"""The committed generated modules are exactly what the .proto files generate."""

from __future__ import annotations

import difflib

import pytest

from kvmesh.protos import generate as gen


def test_generated_modules_match_the_protos(tmp_path):
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        pytest.fail(
            "grpcio-tools is missing: run `make setup` (or `pip install -e '.[dev]'`)",
            pytrace=False,
        )
    fresh = gen.generate(tmp_path)
    committed = gen.generated_files(gen.PROTO_ROOT)
    assert fresh, "no .proto files were compiled"
    assert committed == fresh, (
        f"generated files differ: committed {[str(p) for p in committed]}, "
        f"fresh {[str(p) for p in fresh]}; run `make protos`"
    )
    for rel in fresh:
        want = (tmp_path / rel).read_text()
        got = (gen.PROTO_ROOT / rel).read_text()
        if got != want:
            diff = "".join(
                difflib.unified_diff(
                    got.splitlines(True), want.splitlines(True), f"committed/{rel}", f"fresh/{rel}"
                )
            )
            pytest.fail(f"protos/{rel} is stale; run `make protos`\n{diff[:4000]}")


def test_every_proto_has_its_modules():
    stems = {p.stem for p in gen.proto_files()}
    assert stems >= {"inference", "kv_transfer"}
    names = {p.name for p in gen.generated_files(gen.PROTO_ROOT)}
    for stem in stems:
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names


def test_generated_imports_resolve_inside_kvmesh_protos():
    from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc, kv_transfer_pb2_grpc

    assert inference_pb2_grpc.InferenceStub and kv_transfer_pb2_grpc.KVTransferStub
    for rel in gen.generated_files(gen.PROTO_ROOT):
        text = (gen.PROTO_ROOT / rel).read_text()
        assert "from kvmesh.v1 " not in text and "import kvmesh.v1" not in text, rel
