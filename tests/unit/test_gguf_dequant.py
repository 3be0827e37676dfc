"""The loader's GGUF dequantizer (Q4_0, Q4_1, Q8_0 in torch) against the gguf package's
numpy one, bit for bit, on random blocks and on blocks whose fp16 scales and minimums are
the special values (+-inf, NaN, -0, subnormals). The real model's tensors:
tests/integration/test_gguf_reader.py."""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from kvmesh.worker.models.loader import dequantize_gguf

SIZES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes a block of 32 weights
SPECIAL = np.array([np.inf, -np.inf, np.nan, -0.0, 6e-8, -3e-5, 65504.0, 1.0], np.float16)


def _same(ref: np.ndarray, got) -> bool:
    """The same bits wherever gguf's weight is a number (-0 and +0 apart), NaN where it is
    NaN: a NaN's payload is not promised (torch's fp16 cast of a short tensor keeps a NaN's
    other bits, numpy's quiets it; no real model has a NaN scale)."""
    got = got.numpy()
    if ref.shape != got.shape:
        return False
    nan = np.isnan(ref)
    return np.array_equal(nan, np.isnan(got)) and np.array_equal(
        ref.view(np.uint32)[~nan], got.view(np.uint32)[~nan]
    )


def _blocks(name: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random blocks, then the special fp16 values written into the scales (and Q4_1's
    minimums), one block each, over the first rows."""
    size = SIZES[name]
    data = np.random.default_rng(seed).integers(0, 256, (rows, size * blocks), dtype=np.uint8)
    flat = data.reshape(-1, size)
    for i, value in enumerate(SPECIAL[: len(flat)]):
        flat[i, 0:2] = np.frombuffer(value.tobytes(), np.uint8)
        if name == "Q4_1":  # the minimum, special too, paired with another scale
            flat[i, 2:4] = np.frombuffer(SPECIAL[-1 - i].tobytes(), np.uint8)
    return data


def _ref(data: np.ndarray, qtype) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 -> NaN in both
        return dequantize(data, qtype)


@pytest.mark.parametrize("name", SIZES)
def test_random_and_special_blocks_give_the_gguf_packages_bits(name):
    qtype = gguf.GGMLQuantizationType[name]
    data = _blocks(name, rows=64, blocks=4, seed=0)
    assert _same(_ref(data, qtype), dequantize_gguf(data, qtype))
    # one row (1-D), a strided (non-contiguous) view of rows, and the type as its int
    assert _same(_ref(data[0], qtype), dequantize_gguf(data[0], qtype))
    view = data[::3]
    assert not view.flags.c_contiguous
    assert _same(_ref(view, qtype), dequantize_gguf(view, qtype))
    assert _same(_ref(data, qtype), dequantize_gguf(data, int(qtype)))


@pytest.mark.parametrize("name", SIZES)
def test_a_row_of_broken_blocks_is_a_clear_error(name):
    data = _blocks(name, rows=2, blocks=2, seed=1)
    with pytest.raises(ValueError, match=f"not a whole number of {SIZES[name]}-byte blocks"):
        dequantize_gguf(data[:, :-1], gguf.GGMLQuantizationType[name])


def test_other_types_go_through_the_gguf_package():
    data = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float16).view(np.uint8)
    qtype = gguf.GGMLQuantizationType.F16
    assert _same(dequantize(data, qtype), dequantize_gguf(data, qtype))
