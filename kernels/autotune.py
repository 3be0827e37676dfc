"""GEMM kernels chosen by measurement on the machine at hand, cached per machine.

Which CPU GEMM is fastest for a decode-sized product depends on the CPU: on an AVX-512
machine MKL's packed SGEMM beat ``F.linear`` for 9-64 rows; on a 2-core AVX2/AVX-512 AMD EPYC
it is 2-3x *slower* than ``F.linear``, and oneDNN with a prepacked weight (what vLLM's CPU
build runs) is faster than both. So ``kernels.cpu_linear.PackedLinear`` asks a ``GemmTuner``
which candidate to run for each (weight shape, row bucket) and the tuner times them:

* ``linear``: ``F.linear`` (MKL's sgemm, which repacks the weight on every call);
* ``mkl``: MKL's packed SGEMM, weight packed once for 32 rows, rows padded to 32;
* ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` over a weight reordered once into
  oneDNN's blocked layout.

Rows are bucketed by the next power of two (1, 2, 4, ..., 2048). In ``exact`` mode products of
more than ``MAX_TUNED_ROWS`` (256) rows run ``F.linear`` untuned (no candidate there is
bit-equal and faster, and timing MKL packed on a large weight at 2048 rows took most of a
minute); in ``auto`` mode they race ``F.linear`` against oneDNN only (``PREFILL_CANDIDATES``:
MKL packed multiplies 32 rows at a time and is not made for prefill sizes), which on the
2-core EPYC was 1.0-1.6x faster than ``F.linear`` at prefill shapes (loaded machine), timed
once at ``PREFILL_TUNE_ROWS`` (2,048) for every bucket above 256. The
engine chooses every bucket it will run when it starts (``cpu_linear.warm_up``), so no
request waits on a measurement or sees a GEMM change mid-way; a bucket outside what it
announced is chosen the first time a product of that size runs. A measurement times every
candidate on the real weight, interleaved in rounds (7; 3 once they took 0.25 s, unless the
two fastest are within 15%; short calls more, until 0.05 s or 64 rounds), each candidate's
best round, fastest wins. Best, not median: another process's load only ever adds time,
and at 3 rounds a median is the slow round whenever two of them were disturbed (on the
loaded 2-core VM a 2,048-row gate_up measurement so kept F.linear, which runs 1.3x slower
there than oneDNN; bench/README.md).
The choice is cached in memory (every layer shares a shape) and on disk, in
``$KVMESH_AUTOTUNE_DIR/gemm.json`` (default ``<cache_dir>/autotune``), keyed by the CPU
model, its flags, the torch version, the thread count, the environment variables that cap
the instruction set MKL / oneDNN / ATen and kvmesh's C kernels use (``ISA_ENV``) and the
shape: a cache copied from another machine (other flags) or made by another torch is not
used, its entries are re-measured (and kept beside the new ones); a file that cannot be read
is ignored with a warning and rewritten. Each choice is logged on one line.

Several processes of one host (the workers of a node) share the file: a tuner that misses
takes an exclusive ``flock`` on ``gemm.json.lock``, re-reads the file (another process may
have measured the bucket meanwhile: then it measures nothing), measures, merges its entry
into what it just read and replaces the file through a temporary one. The lock is held
across the measurement, so one process per host measures a bucket and the others read it.

Numerics: ``linear`` and ``mkl`` (16 rows and up) give bit-identical results; ``onednn``
accumulates in another order and differs from ``F.linear`` by float rounding (~1e-5
relative). ``exact`` mode times every candidate first, then checks
the ones faster than ``F.linear``, fastest first, for bit-equality with ``F.linear`` and
takes the first that passes (``F.linear`` when none does). ``PackedLinear`` checks every row
count of a bucket up to 64 rows and, above, its smallest, middle and largest count (GEMM
libraries pick kernels by row count); the check runs once, when measured, so results are
what they were before autotuning. ``auto`` takes the fastest, oneDNN included:
faster on the machines measured. Its last-bit differences can flip an int8/int4 code of a
quantized KV cache, so greedy tokens need not equal, bit for bit, the fake-quantized
transformers reference of tests/integration/test_quantized_engine.py (measured: the int8
test fails under ``auto``, passes under ``exact``/``legacy``); those oracle tests pin
``KVMESH_GEMM=exact``. ``KVMESH_GEMM`` sets the mode: ``exact``, ``auto``, ``legacy`` (the
fixed rule before autotuning: MKL packed for 9-64 rows, else ``F.linear``), or one
candidate's name. Unset, the engine runs ``auto`` over every KV cache format
(``engine_mode``): rounding-level differences, as with the C elementwise kernels; the fp32
transformers parity tests match token for token under it, and the quantized formats'
perplexity guards hold. ``exact`` over a quantized cache also keeps the elementwise ops in
torch (``elementwise_in_c``), so the engine reproduces the torch reference bit for bit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CANDIDATES = ("linear", "mkl", "onednn")
MODES = ("auto", "exact", "legacy", *CANDIDATES)
BUCKETS = tuple(2**i for i in range(12))  # 1 .. 2048 rows (tuned: up to MAX_TUNED_ROWS)
CACHE_FORMAT = 3  # bumped when the candidates or the timing change: old entries are stale
# (2: best round, not median; 3: short calls timed over more rounds, close long ones too)
ROUNDS = 7
TIME_BUDGET_S = 0.25  # a measurement stops after 3 rounds once its rounds took this long
# Short calls (a decode GEMM, a 128-token prefill attention: ~0.1-0.5 ms) get more rounds,
# until their rounds took this long or MAX_ROUNDS ran: 7 samples of a sub-millisecond call
# on a busy 2-core VM left whole buckets with a disturbed best (a cached prefill choice at
# 128 tokens had the C kernel at 4,760 us, 20x its 232 us, and SDPA chosen).
MIN_TIME_S = 0.05
MAX_ROUNDS = 64
# Long calls stop after 3 rounds only when the two fastest candidates are further apart than
# this; closer, they run all ``rounds``: a 3-round best of a 2,048-row gate_up had oneDNN at
# 47.0 ms against F.linear's 45.7 (F.linear kept), where other runs time oneDNN at ~36.
CLOSE = 0.15
MAX_TUNED_ROWS = 256  # larger products run F.linear untuned in exact mode (module doc)
PREFILL_CANDIDATES = ("linear", "onednn")  # auto above MAX_TUNED_ROWS: MKL packed is for small M
# auto: one measurement at this many rows stands for every bucket above MAX_TUNED_ROWS (timing
# each of 512, 1024 and 2048 stalled the first long prompt for ~9.5 s before the engine tuned at
# start). 2,048, the default step budget, not 512: on the 2-core EPYC, oneDNN's lead over
# F.linear for o and down was 6% at 512 rows (under the margin: F.linear kept) and 14-22% at
# 2,048, the rows a full prefill step and a 2,048-token prompt run (bench/README.md). Fewer
# (down to 512) for weights so large that a 2,048-row product would make the start-up
# measurement slow: at most PREFILL_TUNE_MACS multiply-adds a call (``prefill_tune_rows``)
PREFILL_TUNE_ROWS = 2048
PREFILL_TUNE_MIN_ROWS = 512
PREFILL_TUNE_MACS = 4e9  # SmolLM2's largest, gate_up at 2,048 rows: 3.6e9
# auto: a candidate replaces F.linear only when at least this much faster (best time ratio);
# choices made from timing noise would differ host to host for no gain. 5%: best rounds are
# steadier than the medians the 10% of cache format 1 was set for, and at 2,048 rows on the
# 2-core EPYC oneDNN led F.linear by 9.7-10.3% on every prefill shape (bench/README.md)
AUTO_MARGIN = 0.95
# environment that changes which kernels MKL / oneDNN / ATen / kvmesh's C kernels dispatch to:
# part of the key
ISA_ENV = (
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "ATEN_CPU_CAPABILITY",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "KVMESH_CPU_ISA",
)


def prefill_tune_rows(n: int, k: int) -> int:
    """The rows at which ``auto`` measures an (N=n, K=k) weight's prefill-sized products, for
    every bucket above ``MAX_TUNED_ROWS``: ``PREFILL_TUNE_ROWS`` (2,048), halved while a product
    would exceed ``PREFILL_TUNE_MACS`` multiply-adds, never below ``PREFILL_TUNE_MIN_ROWS``."""
    rows = PREFILL_TUNE_ROWS
    while rows > PREFILL_TUNE_MIN_ROWS and rows * n * k > PREFILL_TUNE_MACS:
        rows //= 2
    return rows


def bucket(rows: int) -> int:
    """The bucket of a product with ``rows`` rows: the next power of two, at most 2048."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return BUCKETS[-1]


_CPU: tuple[str, str] | None = None


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its feature flags, from /proc/cpuinfo (``Features`` on Arm);
    elsewhere the model from ``platform`` and no flags. bench/machine.py reports the same."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _cpu() -> tuple[str, str]:
    """(model name, hash of the sorted flags), read once."""
    global _CPU
    if _CPU is None:
        model, flags = cpu_model_and_flags()
        _CPU = (model, hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16])
    return _CPU


@contextlib.contextmanager
def cache_file_lock(path: Path | None, what: str):
    """An exclusive ``flock`` on ``<path>.lock`` across re-read, measure and write: the
    processes of one host sharing an autotune cache file measure one at a time, and each
    merges its entry into what the others wrote. Without a lock (no path, an unwritable
    dir) it still works, racing, with a warning naming ``what`` cache."""
    fd = None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            log.warning("could not lock the %s autotune cache %s: %s", what, path, e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def write_cache_file(path: Path, entries: list[dict], fmt: int, what: str) -> None:
    """Write an autotune cache file atomically (a temp file renamed over it: readers never
    see a partial file); a failure is a warning naming ``what`` cache, never an error."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json.tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": fmt, "entries": entries}, f, indent=1)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.warning("could not write the %s autotune cache %s: %s", what, path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def machine_key() -> dict:
    """What a measurement is valid for: CPU model and flags, torch version, threads now, and
    the environment variables that cap or pin the instruction set MKL / oneDNN / ATen and
    kvmesh's C kernels use."""
    model, flags = _cpu()
    return {
        "cpu": model,
        "flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "isa_env": isa_env(),
    }


def isa_env() -> dict[str, str]:
    """The ``ISA_ENV`` variables set in this process, by name (benches record them too)."""
    return {k: os.environ[k] for k in ISA_ENV if k in os.environ}


def _close(times: dict[str, list[float]]) -> bool:
    """Whether the two fastest candidates' best rounds so far are within ``CLOSE``."""
    best = sorted(min(v) for v in times.values())
    return len(best) > 1 and best[1] <= best[0] * (1 + CLOSE)


def _time_rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Seconds per call of each function in its fastest round, timed in interleaved rounds (a
    load spike from another process then hits every candidate alike; the fastest round is
    the least disturbed one, since load only ever adds time). ``rounds`` rounds, fewer (3)
    once they took ``TIME_BUDGET_S`` unless the two fastest are within ``CLOSE``, more (up to
    ``MAX_ROUNDS``) while they took less than ``MIN_TIME_S``."""
    for f in fns.values():
        f()  # warm: first-call allocations, lazy packing
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    r = 0
    while r < MAX_ROUNDS:
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
        r += 1
        elapsed = time.perf_counter() - start
        if r >= 3 and elapsed > TIME_BUDGET_S and (r >= rounds or not _close(times)):
            break  # big products: 3 rounds suffice unless close, the first start should not wait
        if r >= rounds and elapsed > MIN_TIME_S:
            break  # short calls run on until MIN_TIME_S (or MAX_ROUNDS)
    return {k: min(v) for k, v in times.items()}


class GemmTuner:
    """Chooses a GEMM candidate per (weight shape, bias, row bucket); see the module doc.

    ``cache_path``: the JSON file (None: memory only). ``mode``: one of ``MODES`` (the
    class defaults to ``auto``; the engine's process tuner to ``$KVMESH_GEMM``, ``exact``).
    ``timer``: replaces the measurement (tests), ``timer(fns, rounds) -> {name: seconds}``.
    ``rounds``: the rounds a measurement runs (3 for long calls unless their candidates are
    close, more for short ones: see ``_time_rounds``).
    """

    def __init__(
        self,
        cache_path: Path | None = None,
        *,
        mode: str = "auto",
        rounds: int = ROUNDS,
        timer: Callable[[dict, int], dict[str, float]] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown GEMM mode {mode!r}; accepted: {', '.join(MODES)}")
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.mode = mode
        self.rounds = rounds
        self.timer = timer or _time_rounds
        self.measured = 0  # (shape, bucket) pairs timed by this tuner (tests, logs)
        self._lock = threading.Lock()
        self._choices: dict[tuple, str] = {}
        self._disk: list[dict] | None = None  # entries read from the file, all machines

    # ---------------------------------------------------------------- the cache file

    def _entry_matches(self, e: dict, shape: tuple, rows: int) -> bool:
        return (
            e.get("format") == CACHE_FORMAT
            and e.get("machine") == machine_key()
            and e.get("shape") == list(shape)
            and e.get("rows") == rows
            and e.get("mode") == self.mode
            and e.get("choice") in CANDIDATES
        )

    def _load(self, reread: bool = False) -> list[dict]:
        """The file's entries (all machines), read once; ``reread``: read it again (under the
        file lock, before measuring, so entries other processes wrote since are seen)."""
        if self._disk is not None and not reread:
            return self._disk
        self._disk = []
        if self.cache_path is None or not self.cache_path.exists():
            return self._disk
        try:
            data = json.loads(self.cache_path.read_text())
            entries = data["entries"]
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise ValueError("'entries' is not a list of objects")
            self._disk = entries
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning(
                "GEMM autotune cache %s is unreadable (%s): ignoring it, re-measuring",
                self.cache_path,
                e,
            )
        return self._disk

    def _file_lock(self):
        return cache_file_lock(self.cache_path, "GEMM")

    def _save(self, entry: dict) -> None:
        """Merge ``entry`` into the entries read under the file lock and write them back."""
        self._disk = [e for e in self._load() if not self._same_slot(e, entry)] + [entry]
        if self.cache_path is None:
            return
        write_cache_file(self.cache_path, self._disk, CACHE_FORMAT, "GEMM")

    @staticmethod
    def _same_slot(a: dict, b: dict) -> bool:
        keys = ("machine", "shape", "rows", "mode")
        return all(a.get(k) == b.get(k) for k in keys)

    # ---------------------------------------------------------------- choosing

    def choose(
        self,
        shape: tuple,
        rows: int,
        candidates: dict[str, Callable[[], torch.Tensor]],
        exact: Callable[[str], bool] | None = None,
    ):
        """The candidate name for a product of ``shape`` (N, K, has_bias) at bucket ``rows``.
        ``candidates``: name -> a call computing the product on a tuning input of ``rows``
        rows (only those available on this machine; ``linear`` always). ``exact(name)``:
        whether a candidate is bit-equal to ``F.linear`` over the bucket's row counts (mode
        ``exact``; default: compared on the tuning input only)."""
        key = (*shape, rows, torch.get_num_threads())
        with self._lock:
            got = self._choices.get(key)
            if got is not None and got in candidates:
                return got
            if self.mode in CANDIDATES:
                choice = self.mode if self.mode in candidates else "linear"
            elif self.mode == "legacy":
                choice = "mkl" if "mkl" in candidates and 8 < rows <= 64 else "linear"
            elif rows > MAX_TUNED_ROWS and self.mode != "auto":
                choice = "linear"
            else:
                choice = self._cached(shape, rows, candidates)
                if choice is None:
                    with self._file_lock():
                        self._load(reread=True)  # another process may have measured it
                        choice = self._cached(shape, rows, candidates) or self._measure(
                            shape, rows, candidates, exact
                        )
            self._choices[key] = choice
            return choice

    def _cached(self, shape, rows, candidates) -> str | None:
        for e in self._load():
            if self._entry_matches(e, shape, rows) and e["choice"] in candidates:
                log.debug("GEMM %s rows<=%d: %s (cached)", _name(shape), rows, e["choice"])
                return e["choice"]
        return None

    def _measure(self, shape, rows, candidates, exact=None) -> str:
        """Time every candidate, then (mode ``exact``) check bit-equality only for those
        faster than ``F.linear``, fastest first, stopping at the first exact one."""
        names = list(candidates)
        if len(names) == 1:
            choice, us, why = names[0], {}, "the only candidate"
        else:
            times = self.timer({n: candidates[n] for n in names}, self.rounds)
            us = {n: round(times[n] * 1e6, 1) for n in names}
            why = "best us: " + ", ".join(f"{n} {t:g}" for n, t in us.items())
            order = sorted(names, key=lambda n: times[n])
            choice = order[0]
            if self.mode == "auto" and choice != "linear" and "linear" in times:
                if times[choice] > AUTO_MARGIN * times["linear"]:
                    why += f"; {choice} not {1 - AUTO_MARGIN:.0%} faster: F.linear kept"
                    choice = "linear"
            if self.mode == "exact":
                if exact is None:
                    ref = candidates["linear"]()
                    exact = lambda n: torch.equal(candidates[n](), ref)  # noqa: E731
                rejected = []
                for n in order:
                    if n == "linear" or exact(n):
                        choice = n
                        break
                    rejected.append(n)
                if rejected:
                    why += "; not bit-identical to F.linear: " + ", ".join(rejected)
        self.measured += 1
        log.info("GEMM %s rows<=%d: %s (%s)", _name(shape), rows, choice, why)
        entry = {
            "format": CACHE_FORMAT,
            "machine": machine_key(),
            "shape": list(shape),
            "rows": rows,
            "mode": self.mode,
            "choice": choice,
            "us": us,
        }
        self._save(entry)
        return choice


def _name(shape) -> str:
    n, k, bias = shape
    return f"{k}->{n}{' +bias' if bias else ''}"


_tuners: dict[str, GemmTuner] = {}  # the process's tuners, one per mode
_default_lock = threading.Lock()


def engine_mode() -> str:
    """The mode an engine's linear layers run: ``$KVMESH_GEMM`` when set, else ``auto`` (the
    fastest measured) for every KV cache format. Over quantized caches ``auto``'s last-bit
    differences can move an int8/int4 code, so tests that hold the engine to a
    fake-quantized torch reference bit for bit pin ``KVMESH_GEMM=exact`` (which also keeps
    the elementwise ops in torch: ``elementwise_in_c``)."""
    from kvmesh.worker import envs

    return envs.gemm_mode() or "auto"


def elementwise_in_c(quantized_kv: bool, mode: str) -> bool:
    """Whether an engine serves RMSNorm, SiLU and RoPE with the C kernels (``cpu_ops.c``):
    yes, except over a quantized cache under ``exact``, where they stay in torch (the C
    ones round differently in the last bit, which int4 can turn into another code; ``exact``
    promises the torch reference's bits)."""
    return not (quantized_kv and mode == "exact")


def default_tuner(mode: str | None = None) -> GemmTuner:
    """The process's tuner for ``mode`` (default ``$KVMESH_GEMM``, else ``exact``): cache in
    ``$KVMESH_AUTOTUNE_DIR`` (default ``$KVMESH_CACHE_DIR/autotune``)."""
    from kvmesh.worker import envs

    mode = mode or envs.gemm_mode() or "exact"
    with _default_lock:
        if mode not in _tuners:
            _tuners[mode] = GemmTuner(envs.autotune_dir() / "gemm.json", mode=mode)
        return _tuners[mode]


def reset_default_tuners() -> None:
    """Forget the process's tuners (benchmarks that switch ``KVMESH_GEMM`` in one process)."""
    with _default_lock:
        _tuners.clear()
