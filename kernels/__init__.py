"""Tensor math: the KV page format and quantizers, Triton kernels each beside its torch twin
(cache write, paged decode and prefill attention), and CPU GEMM helpers."""
