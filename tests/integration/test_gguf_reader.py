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


def test_torch_dequantization_gives_the_gguf_packages_bits_on_the_model(smol_src):
    """The loader's own dequantizer against gguf's numpy one, bit for bit, on every tensor
    of the real model (Q4_1, Q8_0, F32). Random and special blocks of each type:
    tests/unit/test_gguf_dequant.py."""
    from kvmesh.worker.models.loader import dequantize_gguf

    types = set()
    for t in GGUFFile(smol_src.path).tensors:
        types.add(t.tensor_type.name)
        x, w = dequantize(t.data, t.tensor_type), dequantize_gguf(t.data, t.tensor_type)
        assert x.shape == tuple(w.shape), t.name
        assert np.array_equal(x.view(np.uint32), w.numpy().view(np.uint32)), t.name
    assert {"Q4_1", "Q8_0"} <= types  # the torch paths ran on real data
