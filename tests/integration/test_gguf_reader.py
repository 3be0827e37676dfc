"""kvmesh's fast GGUF reader agrees with the gguf package's reader on the real model file."""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from kvmesh.worker.models.gguf_file import GGUFFile


def test_metadata_and_every_tensor_equal_the_gguf_package(smol_src):
    ours = GGUFFile(smol_src.path)
    ref = gguf.GGUFReader(str(smol_src.path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):  # the header, which the gguf package lists as fields
            continue
        if key in ours.metadata:
            assert ours.metadata[key] == pytest.approx(field.contents()), key
        else:  # arrays: kvmesh keeps their lengths only
            assert ours.array_lengths[key] == len(field.data), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        x, y = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
        assert x.shape == y.shape == a.shape and np.array_equal(x, y), a.name


def test_damaged_files_are_clear_errors(tmp_path, smol_src):
    data = smol_src.path.read_bytes()
    for name, blob in [("magic.gguf", b"NOPE" + data[4:1000]), ("short.gguf", data[:300])]:
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(ValueError, match=name):
            GGUFFile(path)
