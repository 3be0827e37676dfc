"""Regenerate the Python modules of ``protos/kvmesh/v1/*.proto`` (``make protos``).

protoc writes imports by proto path (``from kvmesh.v1 import inference_pb2``); kvmesh installs
the generated modules as ``kvmesh.protos.kvmesh.v1``, so those imports are rewritten. The
drift test (tests/unit/test_proto_drift.py) runs ``generate`` into a temporary folder and
compares the result with the committed files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # holds kvmesh/v1/*.proto
PROTO_DIR = PROTO_ROOT / "kvmesh" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT_RE = re.compile(r"^(from|import) kvmesh\.v1\b", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """The generated modules under ``root/kvmesh/v1``, relative to ``root``."""
    folder = root / "kvmesh" / "v1"
    return sorted(
        p.relative_to(root)
        for p in folder.iterdir()
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    )


def generate(out_root: Path) -> list[Path]:
    """Compile every proto into ``out_root/kvmesh/v1``; returns the files written (relative)."""
    import grpc_tools
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / "kvmesh" / "v1").mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = generated_files(out_root)
    for rel in written:
        path = out_root / rel
        path.write_text(_IMPORT_RE.sub(r"\1 kvmesh.protos.kvmesh.v1", path.read_text()))
    return written


def main() -> int:
    written = generate(PROTO_ROOT)
    for rel in written:
        print(f"wrote protos/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
