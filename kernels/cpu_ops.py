"""Fused elementwise ops of a Llama decoder layer on CPU (``cpu_ops.c``), beside their
torch twins.

Each C op walks its activation once where the torch twin makes several passes (and, for a
prefill chunk, allocates several fresh multi-MB tensors). float32, contiguous rows; the
wrappers check both and say what is wrong. ``kernels.cpu_native`` builds the library.

Numerics: rotary is bit-equal to its twin (same products and sum, no FMA contraction);
RMSNorm and SiLU differ from torch's vectorised reductions and exp by float rounding only.

Also the copy of restored page payloads into the pool (``copy_pages_cpu``), byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvmesh.kernels.cpu_native import CpuKernelError, CpuLibrary, default_library
from kvmesh.kernels.page_format import check_page_buffers

# ---------------------------------------------------------------------------------- twins


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, H) -> (T, H): weight * (x / sqrt(mean(x^2) + eps)), computed in float32."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D); cos, signed_sin (T, 1, D). Half-split (rotate_half) layout, as Hugging
    Face: x*cos + [-x2, x1]*sin, written as x*cos + roll(x)*[-sin, sin]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> (T, I) silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------- C ops


def _check(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim:
        raise ValueError(
            f"{name} must be a {dim}-d float32 CPU tensor, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _lib(library: CpuLibrary | None) -> CpuLibrary:
    return library or default_library()


def _run(lib: CpuLibrary, name: str, *args) -> None:
    if lib.fn(name)(*args, torch.get_num_threads()):
        raise CpuKernelError(f"{name} rejected its arguments")


def rmsnorm_cpu(x, weight, eps: float, *, library: CpuLibrary | None = None) -> torch.Tensor:
    """As ``rmsnorm_torch``, one pass. x (T, H), weight (H,)."""
    _check("x", x, 2)
    _check("weight", weight, 1)
    T, H = x.shape
    if weight.shape[0] != H:
        raise ValueError(f"weight has {weight.shape[0]} values for rows of {H}")
    out = torch.empty_like(x)
    _run(
        _lib(library),
        "kvmesh_rmsnorm_f32",
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        T,
        H,
        float(eps),
    )
    return out


def add_rmsnorm_cpu(
    residual: torch.Tensor, y: torch.Tensor, weight, eps: float, *, library=None
) -> torch.Tensor:
    """``residual += y`` in place (the residual stream), then return
    ``rmsnorm_torch(residual, weight, eps)``, in one pass. residual, y (T, H)."""
    _check("residual", residual, 2)
    _check("y", y, 2)
    _check("weight", weight, 1)
    if residual.shape != y.shape or weight.shape[0] != residual.shape[1]:
        raise ValueError(
            f"shapes differ: residual {tuple(residual.shape)}, y {tuple(y.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    T, H = residual.shape
    out = torch.empty_like(residual)
    _run(
        _lib(library),
        "kvmesh_add_rmsnorm_f32",
        residual.data_ptr(),
        y.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        T,
        H,
        float(eps),
    )
    return out


def rotary_cpu_(
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    *,
    library: CpuLibrary | None = None,
) -> None:
    """Rotate the first ``heads`` heads of every row of x (T, W) in place, W >= heads *
    head_dim (the fused qkv output: q and k heads first). cos, signed_sin (T, head_dim) or
    (T, 1, head_dim), contiguous."""
    _check("x", x, 2)
    T, W = x.shape
    if head_dim % 2 or heads * head_dim > W:
        raise ValueError(f"{heads} heads of {head_dim} (even) must fit rows of {W}")
    cos, signed_sin = cos.reshape(T, head_dim), signed_sin.reshape(T, head_dim)
    _check("cos", cos, 2)
    _check("signed_sin", signed_sin, 2)
    _run(
        _lib(library),
        "kvmesh_rotary_f32",
        x.data_ptr(),
        cos.data_ptr(),
        signed_sin.data_ptr(),
        T,
        heads,
        head_dim,
        W,
    )


def silu_mul_cpu(gate_up: torch.Tensor, *, library: CpuLibrary | None = None) -> torch.Tensor:
    """As ``silu_mul_torch``, one pass. gate_up (T, 2I)."""
    _check("gate_up", gate_up, 2)
    T, W = gate_up.shape
    if W % 2:
        raise ValueError(f"gate_up needs an even width [gate | up], got {W}")
    out = torch.empty((T, W // 2), dtype=torch.float32)
    _run(_lib(library), "kvmesh_silu_mul_f32", gate_up.data_ptr(), out.data_ptr(), T, W // 2)
    return out


# ------------------------------------------------------------------------- page copies


def copy_pages_cpu(
    pool: torch.Tensor,
    ids: Sequence[int],
    payloads: Sequence,
    *,
    library: CpuLibrary | None = None,
    num_threads: int = 1,
) -> None:
    """Copy ``payloads[i]`` (bytes-like, one page each, any alignment: e.g. views of stored
    objects past their header) into row ``ids[i]`` of ``pool`` ((pages, page_nbytes) uint8,
    contiguous, CPU) in C, with streaming stores where the build has them
    (``kvmesh_copy_pages``): the same bytes as ``pool[ids[i]] = payloads[i]``. Checked
    first (``page_format.check_page_buffers``): a bad call writes nothing. ``num_threads``:
    threads splitting the pages (1: the calling thread only; more need distinct ids)."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.device.type != "cpu":
        raise ValueError(
            f"pool must be a 2-d uint8 CPU tensor, got {pool.dtype} {tuple(pool.shape)} "
            f"on {pool.device}"
        )
    if not pool.is_contiguous():
        raise ValueError(f"pool must be contiguous, got strides {pool.stride()}")
    views = check_page_buffers(pool, ids, payloads)
    if num_threads > 1 and len({int(i) for i in ids}) != len(ids):
        raise ValueError("page ids must be distinct when the copy is split over threads")
    copy_page_views(pool, ids, views, library=library, num_threads=num_threads)


def copy_page_views(pool, ids, views, *, library=None, num_threads: int = 1) -> None:
    """``copy_pages_cpu`` after its checks: ``views`` are the payloads as uint8 arrays
    (``check_page_buffers``' result), ``pool`` a contiguous (pages, page_nbytes) uint8 CPU
    tensor."""
    if not views:
        return
    idx = np.asarray([int(i) for i in ids], dtype=np.int64)
    srcs = np.array([v.ctypes.data for v in views], dtype=np.uint64)
    num_pages, nbytes = pool.shape
    fn = _lib(library).fn("kvmesh_copy_pages")
    if fn(pool.data_ptr(), num_pages, nbytes, idx.ctypes.data, srcs.ctypes.data, len(views),
          max(1, int(num_threads))):  # fmt: skip
        raise CpuKernelError("kvmesh_copy_pages rejected its arguments")
