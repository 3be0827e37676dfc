"""Linear layers with MKL-prepacked weights, for small batches on x86 CPUs.

``F.linear`` repacks the weight matrix on every call, and at decode batch sizes that packing
dominates the product. MKL's packed SGEMM (``torch.ops.mkl``) packs the weight once.

MKL's packed product is fast only when the row count equals the one the packing was made
for (``pack_rows``, 32): at 16 or 48 rows it is no faster than ``F.linear``. So rows are
padded with zeros to a multiple of 32 and multiplied 32 at a time (rows of a GEMM are
independent: padding changes no row's result); from 16 rows up the results are
bit-identical to ``F.linear``. Up to ``min_packed_rows`` (8; the single-sequence decode
shape) and above ``max_packed_rows`` (64; prefill chunks) ``F.linear`` is as fast or faster
and runs instead. What this gains, measured: docs/architecture.md, "Performance on CPU".

The torch twin is ``F.linear`` itself: ``PackedLinear`` falls back to it when MKL is absent
(ARM, non-MKL builds) and for dtypes other than float32.
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
    of the weight in memory). ``pack_rows`` is the row count MKL tunes the packing for and
    the chunk the rows are multiplied in.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        pack_rows: int = 32,
        min_packed_rows: int = 8,
        max_packed_rows: int = 64,
    ):
        self.weight = weight
        self.bias = bias
        self.min_packed_rows = min_packed_rows
        self.max_packed_rows = max_packed_rows
        self.pack_rows = pack_rows
        self.packed = None
        cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        if cpu_fp32 and mkl_packing_available():
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), pack_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        packed_rows = self.min_packed_rows < rows <= self.max_packed_rows
        if self.packed is None or not packed_rows or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        pr = self.pack_rows
        padded = -(-rows // pr) * pr
        if padded != rows:
            xp = x.new_zeros((padded, x.shape[1]))
            xp[:rows] = x
        else:
            xp = x.contiguous()
        outs = [
            torch.ops.mkl._mkl_linear(xp[i : i + pr], self.packed, self.weight, self.bias, pr)
            for i in range(0, padded, pr)
        ]  # (pr, N) each
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        return y[:rows]
