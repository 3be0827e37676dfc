"""The C kernel builds a host can run, for the kernel tests: the native build always, the
AVX2 build (native flags with AVX-512 off) only on an x86 CPU with AVX2, FMA and F16C, the
portable (scalar) build always. On this project's x86 CI machines that is all three; on an
aarch64 host or an x86 one without AVX2 the tests run the two that exist there."""

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
