"""Linear layers on CPU with the GEMM chosen by measurement (``kernels.autotune``).

``F.linear`` repacks the weight matrix on every call, and at decode batch sizes that packing
can dominate the product. Two libraries torch ships pack it once:

* MKL's packed SGEMM (``torch.ops.mkl``): fast only when the row count equals the one the
  packing was made for (``pack_rows``, 32), so rows are padded with zeros to a multiple of
  32 and multiplied 32 at a time (rows of a GEMM are independent: padding changes no row's
  result). From 16 rows up its results are bit-identical to ``F.linear``.
* oneDNN (``torch.ops.mkldnn._linear_pointwise``) over a weight reordered once into its
  blocked layout, as vLLM's CPU build runs; it differs from ``F.linear`` by rounding.

Which is fastest depends on the CPU (an AVX-512 Xeon favoured MKL packed for 9-64 rows; a
2-core EPYC favours oneDNN at nearly every size and MKL packed is slowest there), so
``PackedLinear`` asks a ``GemmTuner`` per row bucket, which measures the candidates once per
machine and caches the choice. Packed copies are made when a bucket first chooses them (each
costs one more copy of the weight in memory).

The torch twin is ``F.linear`` itself: ``PackedLinear`` falls back to it when MKL / oneDNN
are absent (ARM, non-MKL builds) and for dtypes other than float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels import autotune


def mkl_packing_available() -> bool:
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """``y = x @ weight.T + bias`` with the GEMM each row bucket measured fastest.

    ``weight``: (N, K) on CPU; float32 takes the tuned paths, other dtypes ``F.linear``.
    ``tuner``: a ``GemmTuner`` (default: the process's, ``autotune.default_tuner()``; the
    engine sets its own per KV cache format, ``LlamaForCausalLM.set_gemm_tuner``).
    ``pack_rows``: the row count MKL's packing is made for and the chunk its rows run in.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        pack_rows: int = 32,
        tuner: autotune.GemmTuner | None = None,
    ):
        self.weight = weight
        self.bias = bias
        self.pack_rows = pack_rows
        self._tuner = tuner
        self.tunable = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.packed = None  # MKL's packed copy, made on first use
        self.onednn_weight = None  # oneDNN's reordered copy, made on first use
        self._plans: dict[int, dict[int, str]] = {}  # threads -> row bucket -> candidate
        self._tuning = False  # inside tune()

    @property
    def tuner(self) -> autotune.GemmTuner:
        if self._tuner is None:
            self._tuner = autotune.default_tuner()
        return self._tuner

    def use_tuner(self, tuner: autotune.GemmTuner) -> None:
        """Pick GEMMs with ``tuner`` from now on (choices made by the previous one dropped)."""
        self._tuner = tuner
        self._plans.clear()

    @property
    def plan(self) -> dict[int, str]:
        """Row bucket -> candidate, for the thread count now (a choice measured with 2
        threads says nothing about 16)."""
        return self._plans.setdefault(torch.get_num_threads(), {})

    @property
    def shape(self) -> tuple[int, int, bool]:
        return (self.weight.shape[0], self.weight.shape[1], self.bias is not None)

    # ------------------------------------------------------------------ candidates

    def _pack_mkl(self) -> None:
        if self.packed is None:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(
                self.weight.contiguous(), self.pack_rows
            )

    def _pack_onednn(self) -> None:
        if self.onednn_weight is None:
            self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous())

    def _mkl(self, x: torch.Tensor) -> torch.Tensor:
        self._pack_mkl()
        rows, pr = x.shape[0], self.pack_rows
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

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        self._pack_onednn()
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.onednn_weight, self.bias, "none", [], ""
        )

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _candidates(self) -> dict:
        c = {"linear": self._linear}
        if mkl_packing_available():
            c["mkl"] = self._mkl
        if onednn_available():
            c["onednn"] = self._onednn
        return c

    def _choose(self, rows: int) -> str:
        b = autotune.bucket(rows)
        mode = self.tuner.mode
        if b > autotune.MAX_TUNED_ROWS and mode == "auto":
            # one measurement for every prefill-sized bucket
            b = autotune.prefill_tune_rows(*self.weight.shape)
        plan = self.plan
        got = plan.get(b)
        if got is None:
            cands = self._candidates()
            if b > autotune.MAX_TUNED_ROWS and mode == "auto":  # prefill-sized products
                cands = {n: f for n, f in cands.items() if n in autotune.PREFILL_CANDIDATES}
            if len(cands) == 1 or (mode == "exact" and b > autotune.MAX_TUNED_ROWS):
                got = "linear"
            else:
                made: list[torch.Tensor] = []  # the tuning input, made only if measured

                def x() -> torch.Tensor:
                    if not made:
                        g = torch.Generator().manual_seed(b)
                        made.append(torch.randn(b, self.weight.shape[1], generator=g))
                    return made[0]

                calls = {n: (lambda f=f: f(x())) for n, f in cands.items()}
                got = self.tuner.choose(self.shape, b, calls, lambda n: self._exact(cands[n], b))
                if not self._tuning:  # tune() drops them once, after its last bucket
                    self._drop_unused(got)
            plan[b] = got
        return got

    def tune(self, max_rows: int) -> None:
        """Choose the GEMM of every row bucket a product of up to ``max_rows`` rows falls in
        (measured, or read from the tuner's cache) and make the packed copies the choices
        run, so no request pays for either (``warm_up``)."""
        if not self.tunable:
            return
        self._tuning = True  # keep the packed copies across buckets: one reorder, not one each
        try:
            for b in autotune.BUCKETS:
                self._choose(b)
                if b >= max_rows:
                    break
        finally:
            self._tuning = False
        self._drop_unused(None)
        used = set(self.plan.values())
        if "mkl" in used:
            self._pack_mkl()
        if "onednn" in used:
            self._pack_onednn()

    def _exact(self, f, b: int) -> bool:
        """Whether candidate ``f`` equals ``F.linear`` bit for bit at every row count of
        bucket ``b`` (up to 64 rows; above, at its ends and middle): GEMM libraries pick
        kernels by row count, so one size proves nothing about the next."""
        lo = b // 2 + 1
        counts = range(lo, b + 1) if b <= 64 else (lo, (lo + b) // 2, b)
        g = torch.Generator().manual_seed(b + 1)
        for r in counts:
            x = torch.randn(r, self.weight.shape[1], generator=g)
            if not torch.equal(f(x), self._linear(x)):
                return False
        return True

    def _drop_unused(self, chosen: str | None) -> None:
        """Free the packed copies tuning made that no bucket runs (re-made if one does)."""
        used = {c for p in self._plans.values() for c in p.values()} | {chosen}
        if "mkl" not in used:
            self.packed = None
        if "onednn" not in used:
            self.onednn_weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cpu_fp32 = x.dtype == torch.float32 and x.device.type == "cpu"
        if not self.tunable or not cpu_fp32 or x.dim() != 2 or x.shape[0] == 0:
            return self._linear(x)
        choice = self._choose(x.shape[0])
        if choice == "mkl":
            return self._mkl(x)
        if choice == "onednn":
            return self._onednn(x)
        return self._linear(x)


def warm_up(linears: list[tuple[PackedLinear, int]]) -> dict:
    """Tune each ``(layer, max_rows)`` over every row bucket up to ``max_rows`` before any
    request runs (the engine calls it at start): what the tuner's cache holds costs nothing,
    what it lacks is measured here, one shape at a time, with a progress line per shape and a
    summary. A product of more rows than announced still tunes its bucket when it first runs.
    Returns ``{"choices", "measured", "seconds"}``."""
    import time

    log = autotune.log
    todo = [(lin, rows) for lin, rows in linears if lin.tunable and rows > 0]
    if not todo:
        return {"choices": 0, "measured": 0, "seconds": 0.0}
    tuners = {id(lin.tuner): lin.tuner for lin, _ in todo}
    before = sum(t.measured for t in tuners.values())
    t0 = time.monotonic()
    by_shape: dict[tuple, list[tuple[PackedLinear, int]]] = {}
    for lin, rows in todo:
        by_shape.setdefault((lin.shape, rows), []).append((lin, rows))
    modes = ",".join(sorted({t.mode for t in tuners.values()}))
    for i, ((shape, rows), group) in enumerate(by_shape.items(), 1):
        n0, t1 = sum(t.measured for t in tuners.values()), time.monotonic()
        for lin, r in group:
            lin.tune(r)
        n = sum(t.measured for t in tuners.values()) - n0
        if n:  # progress only when something was measured: a cached start stays quiet
            plan = group[0][0].plan
            log.info(
                "GEMM warm-up %d/%d: %s up to %d rows: %s (%d measured, %.1f s)",
                i,
                len(by_shape),
                autotune._name(shape),
                rows,
                ", ".join(f"{b}:{c}" for b, c in sorted(plan.items())),
                n,
                time.monotonic() - t1,
            )
    measured = sum(t.measured for t in tuners.values()) - before
    choices = sum(len(g[0][0].plan) for g in by_shape.values())
    seconds = time.monotonic() - t0
    log.info(
        "GEMM warm-up (%s): %d choices for %d shapes, %d measured, %.1f s",
        modes,
        choices,
        len(by_shape),
        measured,
        seconds,
    )
    return {"choices": choices, "measured": measured, "seconds": round(seconds, 3)}
