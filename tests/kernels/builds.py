"""The C kernel builds a host can run, for the kernel tests: the native build always, the
AVX2 build (native flags with AVX-512 off) only on an x86 CPU with AVX2, FMA and F16C, the
portable (scalar) build always. On this project's x86 CI machines that is all three; on an
aarch64 host or an x86 one without AVX2 the tests run the two that exist there.

One more, only where the CPU runs AVX-512F: the AVX-512 path built without AVX-512DQ
(``avx512_no_dq_builds``), which no native build on a CPU with DQ compiles: the prefill
kernels' exp2 (``pf_exp2`` in cpu_attention.c) then takes its roundscale fallback instead
of ``_mm512_reduce_ps``. The prefill kernels' tests run it; the tests that loop over every
build (the ``libraries`` fixture) run it too."""

import platform

from kvmesh.kernels import cpu_native


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def has_avx2() -> bool:
    return is_x86() and {"avx2", "fma", "f16c"} <= cpu_flags()


# AVX-512F (+AVX2, FMA, F16C) and nothing else of AVX-512, as on a CPU with F but not DQ
# (Xeon Phi): not -march=native, which would bring CD, BW, VL, ... along
AVX512_NO_DQ_FLAGS = (
    *cpu_native.PORTABLE_FLAGS,
    *("-mavx512f", "-mavx2", "-mfma", "-mf16c", "-mno-avx512dq"),
)


def has_avx512f() -> bool:
    return has_avx2() and "avx512f" in cpu_flags()


def avx512_no_dq_builds() -> dict[str, tuple[str, ...]]:
    """{"avx512-nodq": flags} where this CPU runs AVX-512F, else {}."""
    return {"avx512-nodq": AVX512_NO_DQ_FLAGS} if has_avx512f() else {}


def host_builds() -> dict[str, tuple[str, ...]]:
    """name -> compiler flags of every build this host can run."""
    builds = {"native": cpu_native.NATIVE_FLAGS}
    if has_avx2():
        builds["avx2"] = cpu_native.AVX2_FLAGS
    builds["portable"] = cpu_native.PORTABLE_FLAGS
    return builds


def native_vector_bits() -> int:
    """The vector width the native build must reach here: 512 with AVX-512, 256 with AVX2
    (+FMA, F16C), else 0 (scalar: aarch64, old x86)."""
    if not has_avx2():
        return 512 if is_x86() and "avx512f" in cpu_flags() else 0
    return 512 if "avx512f" in cpu_flags() else 256
