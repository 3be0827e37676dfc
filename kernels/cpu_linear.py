"""Linear layers with MKL-prepacked weights, for small batches on x86 CPUs.

``F.linear`` repacks the weight matrix on every call. At decode batch sizes (a few to a few
hundred tokens) that packing dominates: on a 2-core AVX-512 machine a (32 x 576) @
(576 x 1536) product ran at ~55 GFLOP/s through ``F.linear`` and at ~220 GFLOP/s with the
weight packed once (MKL's packed SGEMM, which torch exposes as ``torch.ops.mkl``). For
M >= 32 the results were bit-identical to ``F.linear``; large prefill batches keep
``F.linear``, which is as fast there.

The torch twin is ``F.linear`` itself: ``PackedLinear`` falls back to it when MKL is absent
(ARM, non-MKL builds), for dtypes other than float32, and above ``max_packed_rows``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mkl_packing_available() -> bool:
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """``y = x @ weight.T + bias`` with the weight prepacked for small row counts.

    ``weight``: (N, K) float32 on CPU. The packed copy is built once (it costs one more copy
    of the weight in memory). ``pack_rows`` is the row count MKL tunes the packing for; any
    row count gives the same result.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        pack_rows: int = 32,
        max_packed_rows: int = 256,
    ):
        self.weight = weight
        self.bias = bias
        self.max_packed_rows = max_packed_rows
        self.pack_rows = pack_rows
        self.packed = None
        cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        if cpu_fp32 and mkl_packing_available():
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), pack_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is None or rows > self.max_packed_rows or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.pack_rows)
