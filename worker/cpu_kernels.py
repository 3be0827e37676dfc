"""kvmesh's C kernels for CPUs (``kernels/cpu_native.py``), loaded once per process for the
engine: the attention backend's decode and the model's fused elementwise ops use them."""

from __future__ import annotations

import logging
import threading

from kvmesh.worker import envs

log = logging.getLogger(__name__)
_warned = threading.Event()


def load():
    """The built ``CpuLibrary``, or None where it can't be had: turned off with
    ``KVMESH_CPU_KERNELS=0``, or no working C compiler (one warning per process; the torch
    paths run instead). Built for ``KVMESH_CPU_ISA`` (a bad value raises ValueError)."""
    if not envs.cpu_kernels_enabled():
        return None
    isa = envs.cpu_isa()
    from kvmesh.kernels import cpu_native

    try:
        return cpu_native.build(
            build_dir=envs.cache_dir() / "kernels", cc=envs.c_compiler(), isa=isa
        )
    except cpu_native.CpuKernelError as e:
        if not _warned.is_set():
            _warned.set()
            log.warning("kvmesh's CPU kernels are unavailable, running the torch paths: %s", e)
        return None
