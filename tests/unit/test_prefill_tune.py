"""The cpu backend's fresh causal prefill: SDPA or the C flash kernel, chosen by measurement
(kernels/prefill_tune.py), cached per machine and kernel build; and the backend runs what
was chosen (tests/kernels/test_cpu_prefill_attention.py checks the kernel itself)."""

import json
import logging

import pytest
import torch

from kvmesh.kernels import cpu_attention, prefill_tune
from kvmesh.kernels.prefill_tune import PrefillTuner
from kvmesh.worker import cpu_kernels
from kvmesh.worker.attention.base import (
    AttentionMetadata,
    LayerCache,
    PrefillSpan,
    causal_prefill_mask,
)
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend


class FakeTimer:
    def __init__(self, c=1.0, sdpa=2.0):
        self.t, self.calls = {"c": c, "sdpa": sdpa}, 0

    def __call__(self, fns, rounds):
        self.calls += 1
        return {n: self.t[n] for n in fns}


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels must build here (a C compiler is a test requirement)"
    return lib


def test_measured_once_logged_then_read_from_disk(tmp_path, lib, caplog):
    path = tmp_path / "prefill_attention.json"
    timer = FakeTimer(c=1.0, sdpa=2.0)
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.prefill_tune"):
        t = PrefillTuner(lib, path, timer=timer)
        assert t.use_c(100, 9, 3, 64) and t.use_c(128, 9, 3, 64)  # one bucket: 128
        assert not PrefillTuner(lib, path, timer=FakeTimer(c=3.0)).use_c(100, 9, 3, 128)
    assert timer.calls == 1 and t.measured == 1
    assert "prefill attention Hq=9 Hkv=3 D=64 tokens<=128: c" in caplog.text
    never = FakeTimer(c=9.0)
    assert PrefillTuner(lib, path, timer=never).use_c(70, 9, 3, 64) and never.calls == 0
    entries = json.loads(path.read_text())["entries"]
    assert sorted((e["shape"][2], e["tokens"], e["choice"]) for e in entries) == [
        (64, 128, "c"),
        (128, 128, "sdpa"),
    ]


@pytest.mark.parametrize("field,value", [("machine", {"cpu": "other"}), ("library", "x.so")])
def test_foreign_entries_are_remeasured_and_kept(tmp_path, lib, field, value):
    path = tmp_path / "p.json"
    PrefillTuner(lib, path, timer=FakeTimer(c=1.0)).use_c(2048, 9, 3, 64)
    data = json.loads(path.read_text())
    data["entries"][0][field] = value
    path.write_text(json.dumps(data))
    timer = FakeTimer(c=5.0)
    assert not PrefillTuner(lib, path, timer=timer).use_c(2048, 9, 3, 64)
    assert timer.calls == 1
    entries = json.loads(path.read_text())["entries"]
    assert [e["choice"] for e in entries] == ["c", "sdpa"] and entries[0][field] == value


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path, lib, caplog):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvmesh.kernels.prefill_tune"):
        assert PrefillTuner(lib, path, timer=FakeTimer(c=1.0)).use_c(16, 9, 3, 64)
    assert "unreadable" in caplog.text
    assert json.loads(path.read_text())["entries"][0]["choice"] == "c"


def test_margin_buckets_modes_and_bad_mode(lib, monkeypatch):
    assert not PrefillTuner(lib, timer=FakeTimer(c=0.97, sdpa=1.0)).use_c(64, 9, 3, 64)
    assert PrefillTuner(lib, timer=FakeTimer(c=0.94, sdpa=1.0)).use_c(64, 9, 3, 64)
    assert [prefill_tune.token_bucket(n) for n in (1, 17, 2048, 9000)] == [16, 32, 2048, 2048]
    for mode, want in (("c", True), ("sdpa", False)):
        timer = FakeTimer()
        assert PrefillTuner(lib, mode=mode, timer=timer).use_c(64, 9, 3, 64) is want
        assert timer.calls == 0
    monkeypatch.setenv("KVMESH_PREFILL_ATTN", "fast")
    from kvmesh.worker import envs

    with pytest.raises(ValueError, match="KVMESH_PREFILL_ATTN must be auto, sdpa or c"):
        envs.prefill_attn_mode()


def test_real_measurement_times_both(lib):
    t = PrefillTuner(lib)
    t.use_c(40, 4, 2, 64)
    t.use_c(40, 4, 2, 64, kind="own_page")
    assert t.measured == 2


def test_kinds_are_cached_apart(tmp_path, lib, caplog):
    """The own-page kind has its own entries: a causal choice never answers it, nor the
    reverse; an unknown kind is named."""
    path = tmp_path / "p.json"
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.prefill_tune"):
        assert PrefillTuner(lib, path, timer=FakeTimer(c=1.0)).use_c(100, 9, 3, 64)
        timer = FakeTimer(c=3.0)
        assert not PrefillTuner(lib, path, timer=timer).use_c(100, 9, 3, 64, kind="own_page")
    assert timer.calls == 1
    assert "prefill attention (own page) Hq=9 Hkv=3 D=64 tokens<=128: sdpa" in caplog.text
    never = FakeTimer(c=9.0)
    t = PrefillTuner(lib, path, timer=never)
    assert t.use_c(100, 9, 3, 64) and not t.use_c(100, 9, 3, 64, kind="own_page")
    assert never.calls == 0
    entries = json.loads(path.read_text())["entries"]
    assert sorted((e.get("kind", "causal"), e["choice"]) for e in entries) == [
        ("causal", "c"),
        ("own_page", "sdpa"),
    ]
    with pytest.raises(ValueError, match="kind 'paged'"):
        t.use_c(100, 9, 3, 64, kind="paged")


def test_the_own_page_kind_is_cached_per_page_size_and_residual_pages(tmp_path, lib):
    """A choice timed at 16-token pages and 2 residual pages does not answer a cache of
    32-token pages or of 3 residual pages: each is measured (at its own geometry) and kept."""
    path = tmp_path / "p.json"
    PrefillTuner(lib, path, timer=FakeTimer(c=1.0)).use_c(100, 9, 3, 64, "own_page", (16, 2))
    never = FakeTimer(c=9.0)
    assert PrefillTuner(lib, path, timer=never).use_c(100, 9, 3, 64, "own_page")  # the default
    assert never.calls == 0
    timer = FakeTimer(c=3.0)
    t = PrefillTuner(lib, path, timer=timer)
    assert not t.use_c(100, 9, 3, 64, "own_page", (32, 2))
    assert not t.use_c(100, 9, 3, 64, "own_page", (16, 3))
    assert timer.calls == 2
    pages = sorted(e["page"] for e in json.loads(path.read_text())["entries"])
    assert pages == [[16, 2], [16, 3], [32, 2]]
    with pytest.raises(ValueError, match="block size, residual pages"):
        t.use_c(100, 9, 3, 64, "own_page", (16, 0))


def test_the_own_page_measurement_runs_at_the_given_geometry(lib, monkeypatch):
    """The timed kernel call reads the runs a cache of that geometry has: for the 128-token
    bucket, 8-token pages and W = 1 leave 120 keys in the dequantized run; 32-token pages
    and W = 3, 32."""
    runs = []
    real = cpu_attention.prefill_attention_runs_cpu

    def spy(q, a, b, *rest, **kw):
        runs.append((a[0].shape[0], b[0].shape[0]))
        return real(q, a, b, *rest, **kw)

    monkeypatch.setattr(cpu_attention, "prefill_attention_runs_cpu", spy)
    t = PrefillTuner(lib)
    for page in ((8, 1), (32, 3)):
        t.use_c(70, 4, 2, 64, kind="own_page", page=page)
    assert t.measured == 2
    assert sorted(set(runs)) == [(32, 128), (120, 128)]


def _step(lens, Hkv=3, D=64, bs=16):
    """One step of fresh prefills (no decode) over an fp32 page pool."""
    pages = sum(-(-n // bs) for n in lens) + 1
    pool = {name: torch.zeros(pages, bs, Hkv, D) for name in ("k", "v")}
    cache = LayerCache("fp32", pool)
    spans, slots, s, p = [], [], 0, 1
    for n in lens:
        table = torch.arange(p, p + -(-n // bs))
        spans.append(PrefillSpan(start=s, q_len=n, context_len=n, block_table=table))
        slots.append(p * bs + torch.arange(n))
        s, p = s + n, p + len(table)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_context_lens=torch.zeros(0, dtype=torch.int64),
        prefills=spans,
        block_size=bs,
    )
    return cache, meta


@pytest.mark.parametrize("window", [None, 16])
def test_backend_runs_the_chosen_kernel(lib, monkeypatch, window):
    calls = []
    real = cpu_attention.prefill_attention_cpu

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(cpu_attention, "prefill_attention_cpu", spy)
    lens = [37, 70]
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 64, generator=g) for h in (9, 3, 3))
    outs = {}
    for mode in ("c", "sdpa"):
        be = TorchAttentionBackend(sliding_window=window, native=True)
        be._prefill_tuner = PrefillTuner(lib, mode=mode)
        cache, meta = _step(lens)
        be.prepare(meta)
        outs[mode] = be.forward(q, k, v, cache, 0.125)
        assert torch.equal(cache.views["k"][1:4].reshape(-1, 3, 64)[:37], k[:37])  # K written
    # a window builds a mask: SDPA with it, never the C kernel
    assert calls == ([] if window else [(37, 9, 64), (70, 9, 64)])
    torch.testing.assert_close(outs["c"], outs["sdpa"], rtol=0, atol=2e-5)


def test_engine_start_measures_every_bucket_once(lib):
    """warm_up_prefill (called by the engine at start) chooses each bucket up to the step
    budget, so no request waits on a measurement: the causal kind for float pages, the
    own-page kind for quantized ones (with a window too); nothing for bf16, or float pages
    with a window."""
    be = TorchAttentionBackend(native=True)
    timer = FakeTimer()
    be._prefill_tuner = PrefillTuner(lib, timer=timer)
    be.warm_up_prefill(300, 9, 3, 64, torch.float32, "fp32")
    assert timer.calls == 6  # 16, 32, 64, 128, 256, 512
    be.warm_up_prefill(300, 9, 3, 64, torch.float32, "bf16")  # float pages: cached, no timing
    assert timer.calls == 6
    be.warm_up_prefill(300, 9, 3, 64, torch.float32, "int4")  # the own-page kind: 6 more
    be.warm_up_prefill(300, 9, 3, 64, torch.float32, "int8")  # cached
    assert timer.calls == 12
    b = TorchAttentionBackend(sliding_window=64, native=True)
    b._prefill_tuner = PrefillTuner(lib, timer=(t := FakeTimer()))
    b.warm_up_prefill(300, 9, 3, 64, torch.float32, "int4")
    assert t.calls == 6
    for dtype, fmt, window in ((torch.bfloat16, "fp32", None), (torch.bfloat16, "int4", None),
                               (torch.float32, "fp32", 64)):  # fmt: skip
        b = TorchAttentionBackend(sliding_window=window, native=True)
        t = FakeTimer()
        b._prefill_tuner = PrefillTuner(lib, timer=t)
        b.warm_up_prefill(300, 9, 3, 64, dtype, fmt)
        assert t.calls == 0


def test_engine_calls_the_prefill_warm_up(smol_src, monkeypatch):
    seen = []
    monkeypatch.setattr(TorchAttentionBackend, "warm_up_prefill", lambda self, *a: seen.append(a))
    monkeypatch.setenv("KVMESH_GEMM", "linear")  # no GEMM measurement: not what is tested
    from kvmesh.worker import LLM

    LLM("smollm2-135m-instruct", kv_cache_memory="16MiB", max_num_batched_tokens=64)
    assert seen == [(64, 9, 3, 64, torch.float32, "fp32", (16, 2))]  # (block size, W)


def test_engine_runs_the_chosen_own_page_kernel(smol_src, monkeypatch):
    """Over an int4 cache the cpu backend's prefill chunks run the one-pass C kernel when
    it is chosen (``KVMESH_PREFILL_ATTN=c``), the masked SDPA when SDPA is; both give the
    same tokens, and log-probabilities equal within float rounding (the kernel sums in
    another order than SDPA). With every chunk in C, int4's rotations are fused: the
    chunk's V stays plain and the kernel turns the sums over the int4 pages back
    (``a_rotation``), the ring's exact rows are turned back as they are gathered, a decode
    row in the same step rotates its output in the decode kernel; under SDPA, V and the
    output are rotated in passes of their own. The workload has each: a first chunk
    (70 tokens: pages 0-1 read quantized by the queries of pages 3-4, W = 2), later chunks
    starting mid-page (their window's earlier rows from the ring), and the short prompt
    decoding while the long one prefills."""
    from kvmesh.worker.attention import own_page
    from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

    calls, heads, mixed = [], [], []
    real, real_rows = cpu_attention.prefill_attention_runs_cpu, own_page._exact_rows_in_c
    real_forward = TorchAttentionBackend.forward

    def forward_spy(self, *a, **kw):
        mixed.append(bool(self._prefill) and self._meta.num_decode > 0)
        return real_forward(self, *a, **kw)

    def spy(q, *a, **kw):
        calls.append((q.shape[0], kw.get("a_rotation")))
        return real(q, *a, **kw)

    def rows_spy(*a):
        got = real_rows(*a)
        heads.append((a[5], a[7], got is not None))  # ring rows, their rotation, in C
        return got

    monkeypatch.setattr(cpu_attention, "prefill_attention_runs_cpu", spy)
    monkeypatch.setattr(own_page, "_exact_rows_in_c", rows_spy)
    monkeypatch.setattr(TorchAttentionBackend, "forward", forward_spy)
    monkeypatch.setenv("KVMESH_GEMM", "linear")  # no GEMM measurement: not what is tested
    from kvmesh.worker import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    prompts = [list(range(100, 170)), list(range(300, 321)), list(range(500, 610))]
    got = {}
    for mode in ("c", "sdpa"):
        calls.clear()
        heads.clear()
        mixed.clear()
        monkeypatch.setenv("KVMESH_PREFILL_ATTN", mode)
        monkeypatch.setattr(prefill_tune, "_tuner", None)  # the mode is read with the tuner
        llm = LLM(
            "smollm2-135m-instruct",
            kv_cache_dtype="int4",
            kv_cache_memory="16MiB",
            max_num_batched_tokens=48,
        )
        got[mode] = llm.generate(prompts, params)
        layers = llm.engine.model_config.num_layers
        if mode == "c":  # every chunk in C, each with the rotation fused
            assert calls and len(calls) % layers == 0
            assert {rot for _, rot in calls} == {64}
            assert any(h > 0 and rot == 64 and in_c for h, rot, in_c in heads)
            assert any(mixed)  # a decode row and a chunk in one step
        else:  # SDPA: the ring's rows stay rotated
            assert calls == [] and all(not rot for _, rot, _ in heads)
        del llm
    for c_out, sdpa_out in zip(got["c"], got["sdpa"]):
        assert c_out.token_ids == sdpa_out.token_ids
        c, sdpa = (torch.tensor(o.logprobs) for o in (c_out, sdpa_out))
        torch.testing.assert_close(c, sdpa, atol=1e-3, rtol=0)
        assert not torch.equal(torch.zeros_like(c), c)  # logprobs were returned


@pytest.mark.parametrize("window", [None, 16])
def test_a_chunk_after_context_runs_the_chosen_kernel(lib, monkeypatch, window):
    """A chunk of 21 queries after 43 cached tokens (a prefix hit, or a later chunk): the C
    kernel over the gathered pages (ctx > n) when chosen, equal to the masked SDPA; with a
    window, the SDPA."""
    calls = []
    real = cpu_attention.prefill_attention_cpu

    def spy(*a, **kw):
        calls.append((a[0].shape[0], a[1].shape[0]))
        return real(*a, **kw)

    monkeypatch.setattr(cpu_attention, "prefill_attention_cpu", spy)
    bs, n, ctx = 16, 21, 64
    g = torch.Generator().manual_seed(1)
    cached_k, cached_v = (torch.randn(ctx - n, 3, 64, generator=g) for _ in range(2))
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (9, 3, 3))
    outs = {}
    for mode in ("c", "sdpa"):
        pool = {name: torch.zeros(5, bs, 3, 64) for name in ("k", "v")}
        pool["k"].view(-1, 3, 64)[bs : bs + ctx - n] = cached_k  # pages 1..3, in order
        pool["v"].view(-1, 3, 64)[bs : bs + ctx - n] = cached_v
        cache = LayerCache("fp32", pool)
        span = PrefillSpan(start=0, q_len=n, context_len=ctx, block_table=torch.arange(1, 5))
        meta = AttentionMetadata(
            slot_mapping=bs + torch.arange(ctx - n, ctx),
            num_decode=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
            decode_context_lens=torch.zeros(0, dtype=torch.int64),
            prefills=[span],
            block_size=bs,
        )
        be = TorchAttentionBackend(sliding_window=window, native=True)
        be._prefill_tuner = PrefillTuner(lib, mode=mode)
        be.prepare(meta)
        outs[mode] = be.forward(q, k, v, cache, 0.125)
    assert calls == ([] if window else [(n, ctx)])
    torch.testing.assert_close(outs["c"], outs["sdpa"], rtol=0, atol=2e-5)
    # and the SDPA path is the reference: every query sees the cached keys and its own
    keys, vals = torch.cat([cached_k, k]), torch.cat([cached_v, v])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(),
        keys.transpose(0, 1)[None].double(),
        vals.transpose(0, 1)[None].double(),
        attn_mask=causal_prefill_mask(span, torch.device("cpu"), window),
        scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(outs["sdpa"].double(), ref, rtol=0, atol=2e-5)
