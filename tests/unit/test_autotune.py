"""The GEMM autotuner's cache (kernels/autotune.py): choices are measured once per machine and
reused; entries from another machine or another cache format are re-measured; an unreadable
file is ignored with a warning."""

import json
import logging

import pytest
import torch

from kvmesh.kernels import autotune
from kvmesh.kernels.autotune import GemmTuner
from kvmesh.kernels.cpu_linear import PackedLinear, warm_up


class FakeTimer:
    """Times nothing: says ``fastest`` is fastest, and counts the measurements."""

    def __init__(self, fastest="onednn"):
        self.fastest, self.calls = fastest, 0

    def __call__(self, fns, rounds):
        self.calls += 1
        return {n: (1.0 if n == self.fastest else 2.0) for n in fns}


def _run(tuner, rows=16):
    lin = PackedLinear(torch.randn(48, 32), tuner=tuner)
    lin(torch.randn(rows, 32))
    return lin


def _run_via(via, tuner, rows=16):
    """A product of ``rows`` rows (``call``), or the engine's start-up warm-up up to that many
    rows (``warm_up``): the two ways a bucket is chosen; both read and write the cache alike.
    Returns the layer and the chosen plan of the bucket of ``rows``."""
    if via == "call":
        lin = _run(tuner, rows)
    else:
        lin = PackedLinear(torch.randn(48, 32), tuner=tuner)
        warm_up([(lin, rows)])
    return lin, lin.plan[autotune.bucket(rows)]


def test_choice_is_measured_once_then_read_from_disk(tmp_path, caplog):
    path = tmp_path / "autotune" / "gemm.json"
    timer = FakeTimer("onednn")
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.autotune"):
        lin = _run(GemmTuner(path, timer=timer))
    assert lin.plan == {16: "onednn"} and timer.calls == 1
    assert any("GEMM 32->48 rows<=16: onednn" in r.getMessage() for r in caplog.records)
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1 and entries[0]["machine"] == autotune.machine_key()
    # a second process (a fresh tuner) on the same machine measures nothing
    again = FakeTimer("linear")
    assert _run(GemmTuner(path, timer=again)).plan == {16: "onednn"} and again.calls == 0
    # another bucket is measured and added beside the first
    _run(GemmTuner(path, timer=again), rows=3)
    assert again.calls == 1 and len(json.loads(path.read_text())["entries"]) == 2


@pytest.mark.parametrize(
    "field,value",
    [("flags", "0123456789abcdef"), ("cpu", "Another CPU"), ("torch", "1.0.0"), ("format", 0)],
)
@pytest.mark.parametrize("via", ["call", "warm_up"])
def test_foreign_or_stale_entries_are_remeasured_and_kept(tmp_path, field, value, via):
    path = tmp_path / "gemm.json"
    _run(GemmTuner(path, timer=FakeTimer("mkl")))
    data = json.loads(path.read_text())
    (entry,) = data["entries"]
    if field == "format":
        entry["format"] = value  # made by an older kvmesh's candidate set
    else:
        entry["machine"][field] = value  # copied from another machine / torch
    path.write_text(json.dumps(data))
    timer = FakeTimer("onednn")
    assert _run_via(via, GemmTuner(path, timer=timer), rows=9)[1] == "onednn"
    assert timer.calls == (1 if via == "call" else 5)  # warm-up: buckets 1, 2, 4, 8, 16
    entries = json.loads(path.read_text())["entries"]
    choices = sorted(e["choice"] for e in entries if e["rows"] == 16)
    if field == "format":
        assert choices == ["onednn"]  # the stale entry of this machine is replaced
    else:
        assert choices == ["mkl", "onednn"]  # the foreign entry stays for its own machine


@pytest.mark.parametrize(
    "text", ["{not json", '{"entries": 3}', '{"format": 1}', "[1, 2]", '{"entries": [1]}']
)
@pytest.mark.parametrize("via", ["call", "warm_up"])
def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, text, via):
    path = tmp_path / "gemm.json"
    path.write_text(text)
    timer = FakeTimer("onednn")
    with caplog.at_level(logging.WARNING, logger="kvmesh.kernels.autotune"):
        assert _run_via(via, GemmTuner(path, timer=timer))[1] == "onednn"
    assert timer.calls == (1 if via == "call" else 5)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("unreadable" in m and str(path) in m for m in msgs)
    assert json.loads(path.read_text())["entries"][0]["choice"] == "onednn"


def test_fixed_modes_measure_nothing_and_bad_mode_is_named(tmp_path):
    timer = FakeTimer()
    assert _run(GemmTuner(tmp_path / "g.json", mode="mkl", timer=timer)).plan == {16: "mkl"}
    legacy = GemmTuner(None, mode="legacy", timer=timer)
    assert _run(legacy, rows=8).plan == {8: "linear"} and _run(legacy, rows=9).plan == {16: "mkl"}
    assert timer.calls == 0 and not (tmp_path / "g.json").exists()
    with pytest.raises(ValueError, match="unknown GEMM mode 'fastest'.*auto"):
        GemmTuner(None, mode="fastest")


def test_exact_mode_times_first_then_checks_faster_candidates_fastest_first(monkeypatch):
    seen, checked = [], []

    def timer(fns, rounds):
        seen.append(set(fns))
        return {"onednn": 1.0, "mkl": 1.5, "linear": 2.0}

    def exact(self, f, b):  # oneDNN is not bit-equal, MKL packed is
        checked.append(f.__name__)
        return f.__name__ == "_mkl"

    monkeypatch.setattr(PackedLinear, "_exact", exact)
    lin = _run(GemmTuner(None, mode="exact", timer=timer), rows=16)
    assert seen == [{"linear", "mkl", "onednn"}]  # every candidate timed, once
    assert checked == ["_onednn", "_mkl"] and lin.plan == {16: "mkl"}
    # a candidate slower than F.linear is never checked: linear wins unchecked
    checked.clear()
    slow = lambda fns, rounds: {"onednn": 3.0, "mkl": 1.0, "linear": 2.0}  # noqa: E731
    monkeypatch.setattr(PackedLinear, "_exact", lambda self, f, b: checked.append(f) or False)
    assert _run(GemmTuner(None, mode="exact", timer=slow), rows=16).plan == {16: "linear"}
    assert len(checked) == 1  # mkl only


def test_exact_mode_rejects_onednn_by_the_real_check():
    timer = FakeTimer("onednn")  # oneDNN "fastest": the bit-equality check must reject it
    lin = _run(GemmTuner(None, mode="exact", timer=timer), rows=16)
    assert timer.calls == 1 and lin.plan[16] in ("linear", "mkl")


def test_products_above_256_rows_exact_runs_f_linear_auto_races_linear_and_onednn():
    P = autotune.PREFILL_TUNE_ROWS
    timer = FakeTimer("onednn")
    tuner = GemmTuner(None, mode="exact", timer=timer)
    lin = _run(tuner, rows=257)
    assert lin.plan == {512: "linear"} and timer.calls == 0 and tuner.measured == 0
    assert _run(GemmTuner(None, mode="auto", timer=timer), rows=256).plan == {256: "onednn"}
    # auto tunes prefill-sized products too, MKL packed (made for small M) left out
    seen = []
    timer2 = lambda fns, rounds: seen.append(set(fns)) or {n: 1.0 for n in fns}  # noqa: E731
    auto = GemmTuner(None, mode="auto", timer=timer2)
    assert _run(auto, rows=2048).plan == {P: "linear"} and auto.measured == 1
    assert seen == [set(autotune.PREFILL_CANDIDATES)]
    # one measurement (at PREFILL_TUNE_ROWS) stands for every prefill-sized bucket
    lin = _run(GemmTuner(None, mode="auto", timer=timer), rows=700)
    assert lin.plan == {P: "onednn"} and lin(torch.randn(1500, lin.weight.shape[1])) is not None
    assert lin.plan == {P: "onednn"}


def test_prefill_measurement_rows_shrink_for_huge_weights_only(monkeypatch):
    """2,048 rows for every SmolLM2-sized weight; a weight whose 2,048-row product would pass
    PREFILL_TUNE_MACS is measured at fewer rows (never under 512), and a layer's plan and the
    tuning input it times follow."""
    rows = autotune.prefill_tune_rows
    assert rows(960, 576) == rows(3072, 576) == rows(576, 1536) == 2048  # SmolLM2 projections
    assert rows(49152, 576) == 512  # its LM head (prefill-sized only when scoring)
    assert rows(14336 * 2, 4096) == rows(4096, 4096) == 512  # an 8B model's: the floor
    assert rows(1024, 1024 * 3) == 1024  # 2,048 x 3.1e6 = 6.4e9 > 4e9 >= 1,024 x 3.1e6
    seen = []

    def timer(fns, rounds):
        seen.append({n: f().shape[0] for n, f in fns.items()})
        return {n: 1.0 for n in fns}

    monkeypatch.setattr(autotune, "PREFILL_TUNE_MACS", 48 * 32 * 1024)  # a 48 x 32 weight: 1,024
    lin = PackedLinear(torch.randn(48, 32), tuner=GemmTuner(None, mode="auto", timer=timer))
    lin(torch.randn(700, 32))
    assert lin.plan == {1024: "linear"} and seen == [{"linear": 1024, "onednn": 1024}]


def test_auto_keeps_f_linear_unless_a_candidate_is_clearly_faster():
    near = lambda fns, rounds: {n: (0.96 if n != "linear" else 1.0) for n in fns}  # noqa: E731
    assert _run(GemmTuner(None, mode="auto", timer=near), rows=16).plan == {16: "linear"}
    far = lambda fns, rounds: {n: (0.8 if n == "onednn" else 1.0) for n in fns}  # noqa: E731
    assert _run(GemmTuner(None, mode="auto", timer=far), rows=16).plan == {16: "onednn"}


def test_engine_mode_is_auto_for_every_cache_format_unless_set(monkeypatch):
    monkeypatch.delenv("KVMESH_GEMM", raising=False)
    assert autotune.engine_mode() == "auto"
    monkeypatch.setenv("KVMESH_GEMM", "Legacy")
    assert autotune.engine_mode() == "legacy"
    monkeypatch.setenv("KVMESH_GEMM", "fastest")
    with pytest.raises(ValueError, match="unknown GEMM mode 'fastest'"):
        autotune.default_tuner(autotune.engine_mode())
    # the elementwise C kernels: everywhere but under exact over a quantized cache
    assert autotune.elementwise_in_c(True, "auto") and autotune.elementwise_in_c(False, "exact")
    assert not autotune.elementwise_in_c(True, "exact")


def test_engine_sets_its_layers_tuner_by_mode(smol_src, monkeypatch):
    """Unset, an fp32-cache and an int8-cache engine both race oneDNN (auto), with the C
    elementwise kernels; ``KVMESH_GEMM=exact`` over int8 keeps bit-equality with F.linear
    and the elementwise ops in torch: one process, three engines, two tuners, each tuned at
    start; a restart reads every choice from the cache file."""
    from kvmesh.worker import LLM, SamplingParams

    modes, in_c = {}, {}
    for fmt, env in (("auto", None), ("int8", None), ("int8", "exact")):
        if env is None:
            monkeypatch.delenv("KVMESH_GEMM", raising=False)
        else:
            monkeypatch.setenv("KVMESH_GEMM", env)
        llm = LLM("smollm2-135m-instruct", kv_cache_dtype=fmt, kv_cache_memory="32MiB")
        model = llm.engine.model
        tuners = {id(lin.tuner) for lin in model._packed()}
        assert len(tuners) == 1 and len(model._packed()) == 4 * len(model.model.layers) + 1
        modes[fmt, env] = model.head.tuner.mode
        in_c[fmt, env] = model.cpu_kernels is not None
        # chosen at start (warm-up): the head up to max_num_seqs (128) rows, the projections
        # up to the step budget (2,048): in auto one measurement at prefill_tune_rows stands for
        # every bucket above 256; exact runs F.linear in each of them
        assert max(model.head.plan) == 128
        for x in model._packed()[1:]:
            big = {b for b in x.plan if b > autotune.MAX_TUNED_ROWS}
            if modes[fmt, env] == "auto":
                assert big == {autotune.prefill_tune_rows(*x.weight.shape)}
            else:
                assert big == {512, 1024, 2048}
        del llm
    assert modes == {("auto", None): "auto", ("int8", None): "auto", ("int8", "exact"): "exact"}
    assert in_c == {("auto", None): True, ("int8", None): True, ("int8", "exact"): False}
    monkeypatch.delenv("KVMESH_GEMM", raising=False)
    # a second start with gemm.json written (a fresh process tuner) measures nothing, and
    # neither does a request
    autotune.reset_default_tuners()
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="32MiB")
    llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.model.head.tuner.measured == 0


def test_plan_is_kept_per_thread_count():
    timer = FakeTimer("onednn")
    tuner = GemmTuner(None, timer=timer)
    lin = _run(tuner)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert lin.plan == {}
        lin(torch.randn(16, 32))
        assert timer.calls == 2 and lin.plan == {16: "onednn"}
    finally:
        torch.set_num_threads(threads)


def test_isa_environment_is_part_of_the_machine_key(monkeypatch):
    for name in autotune.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = autotune.machine_key()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert autotune.machine_key() != plain
    assert autotune.machine_key()["isa_env"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    # kvmesh's own kernels' cap too: the prefill-attention tuner times them
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx2")
    assert autotune.machine_key()["isa_env"] == {
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "KVMESH_CPU_ISA": "avx2",
    }


def test_two_tuners_sharing_a_file_keep_each_others_entries(tmp_path):
    """Two worker processes (two tuners, each with its own in-memory copy) write different
    entries into one gemm.json: none is lost, and one re-reads what the other measured."""
    path = tmp_path / "gemm.json"
    a, b = GemmTuner(path, timer=FakeTimer("linear")), GemmTuner(path, timer=FakeTimer("linear"))
    PackedLinear(torch.randn(48, 32), tuner=a)(torch.randn(16, 32))
    PackedLinear(torch.randn(64, 32), tuner=b)(torch.randn(16, 32))
    PackedLinear(torch.randn(80, 32), tuner=a)(torch.randn(16, 32))  # a's copy is stale
    shapes = sorted(e["shape"][0] for e in json.loads(path.read_text())["entries"])
    assert shapes == [48, 64, 80]
    # b misses its in-memory copy for 80, re-reads the file under the lock: measures nothing
    PackedLinear(torch.randn(80, 32), tuner=b)(torch.randn(16, 32))
    assert b.timer.calls == 1 and (path.parent / "gemm.json.lock").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_real_measurement_picks_a_candidate_and_logs_times(tmp_path, caplog):
    tuner = GemmTuner(tmp_path / "g.json", rounds=2)
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.autotune"):
        lin = _run(tuner, rows=5)
    assert lin.plan[8] in autotune.CANDIDATES and tuner.measured == 1
    (msg,) = [r.getMessage() for r in caplog.records if "GEMM" in r.getMessage()]
    assert "best us: linear" in msg and "mkl" in msg and "onednn" in msg


def _tune_in_a_process(i, path):
    import time

    def timer(fns, rounds):
        time.sleep(0.02)  # a measurement takes time: the processes overlap
        return {n: (1.0 if n == "linear" else 2.0) for n in fns}

    tuner = GemmTuner(path, timer=timer)
    for j in range(4):
        PackedLinear(torch.randn(8 * (i * 4 + j + 1), 16), tuner=tuner)(torch.randn(4, 16))


def test_concurrent_processes_lose_no_entries(tmp_path):
    """Three worker processes tuning different shapes into one gemm.json at the same time
    (before the file lock, most entries were lost: each wrote back its own stale copy)."""
    import multiprocessing

    path = tmp_path / "gemm.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_tune_in_a_process, args=(i, path)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(json.loads(path.read_text())["entries"]) == 12


def test_warm_up_measures_each_shape_once_and_prepacks_what_it_chose(tmp_path, caplog):
    """The engine's start-up warm-up: every bucket up to each layer's row limit is chosen
    before any product runs (layers of one shape share the measurement), the packed copies
    the choices need are made, and progress is logged per shape; the next start, with the
    cache file written, measures nothing and logs only its summary line."""
    path = tmp_path / "gemm.json"
    timer = FakeTimer("onednn")
    tuner = GemmTuner(path, timer=timer)
    same = [PackedLinear(torch.randn(48, 32), tuner=tuner) for _ in range(3)]
    head = PackedLinear(torch.randn(80, 32), tuner=tuner)
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.autotune"):
        got = warm_up([(lin, 600) for lin in same] + [(head, 4)])
    # 48-wide: buckets 1..256 and one measurement standing for 512..2048; head 1, 2, 4
    assert timer.calls == tuner.measured == 10 + 3 == got["measured"]
    assert all(lin.plan == same[0].plan for lin in same) and len(same[0].plan) == 10
    assert max(same[0].plan) == autotune.PREFILL_TUNE_ROWS and sorted(head.plan) == [1, 2, 4]
    assert all(lin.onednn_weight is not None and lin.packed is None for lin in [*same, head])
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("GEMM warm-up 1/2" in m or "GEMM warm-up 2/2" in m for m in msgs) == 2
    assert "13 measured" in msgs[-1]
    # products after the warm-up measure nothing, whatever their size within the limits
    for rows in (1, 3, 200, 600):
        same[1](torch.randn(rows, 32))
    assert timer.calls == 13
    # a second start (fresh tuner, the same file): every choice from the cache, no progress
    caplog.clear()
    again = FakeTimer("linear")
    fresh = [PackedLinear(torch.randn(48, 32), tuner=GemmTuner(path, timer=again))]
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.autotune"):
        got = warm_up([(fresh[0], 600)])
    assert again.calls == 0 and got["measured"] == 0 and fresh[0].plan == same[0].plan
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "0 measured" in msgs[0]


def test_warm_up_in_exact_mode_leaves_prefill_sizes_on_f_linear_untimed(tmp_path):
    timer = FakeTimer("linear")
    lin = PackedLinear(torch.randn(48, 32), tuner=GemmTuner(None, mode="exact", timer=timer))
    warm_up([(lin, 2048)])
    assert timer.calls == 9  # 1..256
    assert lin.plan[512] == lin.plan[1024] == lin.plan[2048] == "linear"
    assert lin.packed is None and lin.onednn_weight is None


def test_a_candidate_slowed_in_most_rounds_still_wins(tmp_path):
    """Another process's load only ever adds time: oneDNN, 5 ms a call but slowed to 40 ms in
    two of the three rounds by a (simulated) load spike, still beats F.linear's steady 8 ms.
    The median of those rounds (40 ms) would have kept F.linear."""
    import time

    calls = {"onednn": 0}

    def linear():
        time.sleep(0.008)

    def onednn():
        calls["onednn"] += 1
        time.sleep(0.040 if calls["onednn"] in (2, 3) else 0.005)  # call 1 is the warm-up

    tuner = GemmTuner(tmp_path / "g.json", rounds=3)
    assert tuner.choose((48, 32, False), 2048, {"linear": linear, "onednn": onednn}) == "onednn"
    assert calls["onednn"] == 4  # the warm-up call and three rounds


def test_timer_rounds_grow_for_short_calls_and_shrink_for_long_ones(monkeypatch):
    """The round count adapts to the call's length: sub-millisecond calls run until
    ``MIN_TIME_S`` (capped at ``MAX_ROUNDS``) so one disturbed round does not decide a bucket,
    calls past ``TIME_BUDGET_S`` stop after 3 rounds unless the two candidates are within
    ``CLOSE``, and anything in between runs ``rounds``. Every count includes the warm-up
    call."""
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])

    def counting(seconds):
        calls = [0]

        def f():
            calls[0] += 1
            clock[0] += seconds

        return f, calls

    for seconds, other, want_rounds in (
        (1e-5, 1e-5, autotune.MAX_ROUNDS),  # 64 rounds take 1.3 ms: under MIN_TIME_S
        (2e-3, 2e-3, 13),  # 0.05 s of rounds (2 candidates x 2 ms): past ROUNDS
        (4e-3, 4e-3, autotune.ROUNDS),  # 7 rounds take 0.056 s: past MIN_TIME_S at ROUNDS
        (0.05, 0.1, 3),  # 3 rounds take 0.45 s: past TIME_BUDGET_S, and 2x apart
        (0.05, 0.055, autotune.ROUNDS),  # as long, but within CLOSE: all ROUNDS
    ):
        f, n = counting(seconds)
        g, m = counting(other)
        t = autotune._time_rounds({"a": f, "b": g}, autotune.ROUNDS)
        assert n[0] == m[0] == want_rounds + 1, (seconds, other, n[0])
        assert t["a"] == pytest.approx(seconds) and t["b"] == pytest.approx(other)
