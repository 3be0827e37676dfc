"""Kernel tests run Triton under its interpreter on CPU.

``triton.jit`` decides at decoration time whether a function is interpreted, and Triton's
own library functions (``tl.cdiv``, ...) are decorated when ``triton`` is imported, so
``TRITON_INTERPRET=1`` must be set before anything imports triton. Setting it here works as
long as no test module collected earlier imports a kernel module at import time; if one
does, fail loudly instead of with an obscure interpreter error.
"""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
        "set it in the environment or at the top of tests/conftest.py"
    )
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402  (after TRITON_INTERPRET is set)
from builds import avx512_no_dq_builds, host_builds, native_vector_bits  # noqa: E402

from kvmesh.kernels import cpu_native  # noqa: E402
from kvmesh.worker import envs  # noqa: E402


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Every C kernel build this host runs (tests/kernels/builds.py), AVX-512 without DQ
    included where the CPU has AVX-512F. No compiler is a failure that says how to install
    one, not a skip. The native build must vectorise where the CPU has AVX2 (+FMA, F16C) or
    AVX-512."""
    from concurrent.futures import ThreadPoolExecutor

    d = tmp_path_factory.getbasetemp() / "cpu-kernels"  # one build per flag set per session
    cc = envs.c_compiler()
    flags = {**host_builds(), **avx512_no_dq_builds()}
    # the compilers run side by side (one per build; compile_library renames each finished
    # file into place, so concurrent builds never see a partial one)
    with ThreadPoolExecutor(max_workers=len(flags)) as pool:
        paths = pool.map(
            lambda f: cpu_native.compile_library(build_dir=d, cc=cc, flags=f), flags.values()
        )
        builds = {name: cpu_native.CpuLibrary(p) for name, p in zip(flags, paths)}
    assert builds["native"].vector_bits == native_vector_bits()
    if "avx2" in builds:
        assert builds["avx2"].vector_bits == 256
    if "avx512-nodq" in builds:
        assert builds["avx512-nodq"].vector_bits == 512
    assert builds["portable"].vector_bits == 0
    return builds
