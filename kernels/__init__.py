"""Tensor math: CPU GEMM helpers now; Triton kernels, each beside its torch twin, to come."""
