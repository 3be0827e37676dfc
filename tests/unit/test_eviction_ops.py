"""KV eviction's operations side, without a model: quantized pages that a compaction keeps
whole are copied byte for byte (never requantized), the per-request opt-out
(kv_policy="none") on every path, and the CLI's --kv-budget / --kv-policy."""

import pytest
import torch
from helpers import fill_request_slots

from kvmesh.kernels import cache_write
from kvmesh.kernels.page_format import PageLayout
from kvmesh.worker.eviction.compaction import (
    gather_heads,
    read_layer,
    unchanged_pages,
    write_layer,
)
from kvmesh.worker.kv_memory import KVMemory

BS, H, D, R = 4, 2, 64, 2


def _ref_unchanged(keep: list[list[int]], n: int) -> list[int]:
    """Loop reference: result page j is old page s when every head keeps exactly s's slots."""
    out = []
    for j in range(len(keep[0]) // BS):
        rows = [tuple(h[j * BS : (j + 1) * BS]) for h in keep]
        s = rows[0][0] // BS
        whole = tuple(range(s * BS, s * BS + BS))
        ok = rows[0][0] % BS == 0 and s < n // BS and all(r == whole for r in rows)
        out.append(s if ok else -1)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_unchanged_pages_matches_the_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n = 27  # 6 full pages and a partial one (the residual)
    for _ in range(20):
        K = int(torch.randint(BS, n + 1, (1,), generator=g))
        drop = torch.randperm(n // BS, generator=g)[: int(torch.randint(0, 3, (1,), generator=g))]
        base = [s for s in range(n) if s // BS not in drop.tolist()]  # whole pages dropped
        heads = []
        for _ in range(H):
            slots = list(base)
            if torch.rand((), generator=g) < 0.3:  # this head also drops one token
                slots.pop(int(torch.randint(0, len(slots), (1,), generator=g)))
            heads.append(slots[-K:] if len(slots) >= K else slots)
        K = min(len(x) for x in heads)
        keep = [x[-K:] for x in heads]
        got = unchanged_pages(torch.tensor(keep), n, BS).tolist()
        assert got == _ref_unchanged(keep, n), keep


def _memory(fmt: str, dtype: torch.dtype) -> KVMemory:
    """dtype: the model's, which the residual and compaction's dequantized values are in."""
    layout = PageLayout(fmt, num_layers=1, num_kv_heads=H, head_size=D, block_size=BS)
    return KVMemory(
        layout, "test", 12, dtype=dtype, device=torch.device("cpu"), num_residual_slots=R
    )


def _filled(fmt: str, dtype: torch.dtype):
    """A request's 18 slots (4 full pages + 2 in the residual) in a one-layer cache."""
    g = torch.Generator().manual_seed(0)
    mem = _memory(fmt, dtype)
    cache = mem.layer_caches[0]
    n, slot = 18, 1
    table = [3, 7, 5, 10, 11]
    k = torch.randn(n, H, D, generator=g) * 3
    v = torch.randn(n, H, D, generator=g) * 3
    fill_request_slots(cache, table, k, v, slot, block_size=BS, residual_slots=R)
    return mem, cache, torch.tensor(table), n, slot


# every head keeps old pages 0, 2, 3 whole (old page 1 dropped, as a StreamingLLM or H2O
# decode compaction drops a page's worth) and the residual's two slots
WHOLE = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
# head 1 keeps slot 5 instead of 15: its result pages 1 and 2 change, page 0 does not
MIXED = [0, 1, 2, 3, 5, 8, 9, 10, 11, 12, 13, 14, 16, 17]


def _compact(monkeypatch, fmt, keep, bytewise=True, dtype=torch.bfloat16):
    mem, cache, table, n, slot = _filled(fmt, dtype)
    source = mem.buffer[table].clone()
    quantized = []
    real = cache_write.write_kv_cache

    def spy(**kw):
        quantized.append(kw["complete_pages"].tolist())
        return real(**kw)

    monkeypatch.setattr(cache_write, "write_kv_cache", spy)
    k0, v0 = read_layer(cache, table, n, slot, cache.residual_k.dtype)
    src = unchanged_pages(keep, n, BS)
    copy_src = torch.where(src >= 0, table[src.clamp(min=0)], src) if bytewise else None
    new = torch.tensor([2, 9, 6, 8])
    kk, vv = gather_heads(k0, keep), gather_heads(v0, keep)
    write_layer(cache, kk, vv, new, slot, copy_src)
    return mem, cache, source, new, src, quantized, (kk, vv), slot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_pages_kept_whole_are_copied_bytewise_not_requantized(fmt, dtype, monkeypatch):
    keep = torch.tensor([WHOLE, WHOLE])
    got = _compact(monkeypatch, fmt, keep, dtype=dtype)
    mem, cache, source, new, src, quantized, (kk, vv), slot = got
    assert src.tolist() == [0, 2, 3]
    assert quantized == [[]]  # nothing reached the quantizer
    for j, old in enumerate([0, 2, 3]):
        assert torch.equal(mem.buffer[new[j]], source[old]), j  # codes and scales as stored
    k1, v1 = read_layer(cache, new, 14, slot, torch.float32)
    assert torch.equal(k1[12:], kk[12:].float()) and torch.equal(v1[12:], vv[12:].float())


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_only_changed_pages_are_requantized(fmt, monkeypatch):
    keep = torch.tensor([WHOLE, MIXED])
    mem, cache, source, new, src, quantized, (kk, vv), slot = _compact(monkeypatch, fmt, keep)
    assert src.tolist() == [0, -1, -1]  # page 1 is old page 2 for head 0 only
    assert quantized == [new[1:3].tolist()]
    assert torch.equal(mem.buffer[new[0]], source[0])
    from kvmesh.kernels.quant import dequantize_pages, quantize_pages

    k1, v1 = read_layer(cache, new, 14, slot, torch.float32)
    rk, rv = dequantize_pages(
        fmt, quantize_pages(fmt, kk[None, 4:12].view(2, BS, H, D), vv[None, 4:12].view(2, BS, H, D))
    )
    torch.testing.assert_close(k1[4:12], rk.reshape(8, H, D), rtol=0, atol=1e-6)
    torch.testing.assert_close(v1[4:12], rv.reshape(8, H, D), rtol=0, atol=1e-6)


def test_int4_requantizing_a_kept_page_would_change_its_bytes(monkeypatch):
    """Why the rule matters: without the byte copy (every full page quantized afresh from
    its dequantized values, in the model's bf16) the int4 pages kept whole do not come out
    as stored: each compaction a page survived would add error."""
    keep = torch.tensor([WHOLE, WHOLE])
    mem, _, source, new, _, quantized, _, _ = _compact(monkeypatch, "int4", keep, bytewise=False)
    assert quantized == [new[:3].tolist()]
    assert any(not torch.equal(mem.buffer[new[j]], source[o]) for j, o in enumerate([0, 2, 3]))


# ---------------------------------------------------------------- the opt-out


def test_kv_policy_none_is_the_opt_out_on_every_path():
    from fastapi.testclient import TestClient
    from test_openai_app import Backend

    from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
    from kvmesh.protos.openai_app import build_app
    from kvmesh.worker import SamplingParams
    from kvmesh.worker.config import EvictionConfig
    from kvmesh.worker.inference_servicer import sampling_from_proto

    assert SamplingParams(kv_policy="none").kv_policy == "none"
    with pytest.raises(ValueError, match="kv_policy='none' keeps the full cache.*kv_budget"):
        SamplingParams(kv_policy="none", kv_budget=64)
    with pytest.raises(ValueError, match="kv_policy must be one of .*none"):
        SamplingParams(kv_policy="off")
    sp = sampling_from_proto(ipb.SamplingParams(kv_policy="none"))
    assert (sp.kv_budget, sp.kv_policy) == (None, "none")
    with pytest.raises(ValueError, match="kv_budget"):
        sampling_from_proto(ipb.SamplingParams(kv_policy="none", kv_budget=64))
    backend = Backend()
    with TestClient(build_app(backend)) as c:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "kv_policy": "none"}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    assert backend.seen[-1].sampling.kv_policy == "none"
    # the engine's default is a policy; "none" is a request's word for opting out of it
    with pytest.raises(
        ValueError, match="kv_policy must be one of snapkv, h2o, streaming, random, scissorhands;"
    ):
        EvictionConfig(kv_budget=64, kv_policy="none")


def test_engine_default_budget_without_a_policy_is_refused():
    # a default budget with no policy would fail every request that inherits it
    from kvmesh.worker import SamplingParams
    from kvmesh.worker.config import EvictionConfig

    with pytest.raises(ValueError, match="kv_policy must be .*kv_policy=None with kv_budget=64"):
        EvictionConfig(kv_budget=64, kv_policy=None)
    assert EvictionConfig(kv_budget=None, kv_policy=None).kv_budget is None  # no default: fine
    assert EvictionConfig(kv_budget=64, kv_policy="h2o").kv_policy == "h2o"
    # a request's budget without a policy still inherits the engine's default policy
    assert SamplingParams(kv_budget=64).kv_policy is None


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("command", ["worker", "serve", "generate"])
def test_cli_sets_the_engine_default_budget(command):
    from kvmesh.cluster import cli

    extra = ["--prompt", "x"] if command == "generate" else []
    a = cli.build_parser().parse_args([command, *extra, "--kv-budget", "512", "--kv-policy", "h2o"])
    kw = cli._engine_kwargs(a, peer_tiers=False)
    assert (kw["kv_budget"], kw["kv_policy"]) == (512, "h2o")
    a = cli.build_parser().parse_args([command, *extra])
    kw = cli._engine_kwargs(a, peer_tiers=False)
    assert (kw["kv_budget"], kw["kv_policy"]) == (None, "snapkv")
    if command == "serve":
        from kvmesh.cluster.serve import config_from_args

        a = cli.build_parser().parse_args([command, "--kv-budget", "256"])
        assert config_from_args(a).engine_args["kv_budget"] == 256


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--kv-budget", "3"], "--kv-budget must be an integer in [8,"),
        (["--kv-budget", "64", "--kv-policy", "lru"], "--kv-policy must be one of"),
        (["--kv-budget", "64", "--kv-policy", "none"], "--kv-policy must be one of"),
        (["--kv-policy", "h2o"], "--kv-policy h2o needs a --kv-budget"),
        (["--kv-policy", "snapkv"], "--kv-policy snapkv needs a --kv-budget"),  # the default too
    ],
)
@pytest.mark.parametrize("command", ["worker", "serve"])
def test_cli_refuses_a_bad_budget_before_starting_anything(
    command, flags, needle, capsys, monkeypatch
):
    from kvmesh.cluster import cli, serve
    from kvmesh.worker import server

    def started(*a, **k):  # a flag that got through would start a worker or Ray: fail instead
        raise AssertionError("started before the flags were checked")

    monkeypatch.setattr(server, "serve_worker", started)
    monkeypatch.setattr(serve, "init_ray", started)

    assert cli.main([command, *flags]) == 2
    assert needle in capsys.readouterr().err


def test_cli_rejects_a_budget_that_is_not_a_number(capsys):
    from kvmesh.cluster import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["worker", "--kv-budget", "lots"])
    assert "--kv-budget" in capsys.readouterr().err


def test_a_streaming_decode_compaction_keeps_every_page_but_the_sinks_whole():
    from kvmesh.worker.eviction.policies import streaming_keep

    budget = 10 * BS
    n = budget + BS  # a decode compaction: one page's worth over the budget
    keep = streaming_keep(n, budget, 2).expand(H, -1)
    # result page 0: the 2 sinks and the tail of old page 1 (changed); page j: old page j + 1
    assert unchanged_pages(keep, n, BS).tolist() == [-1, *range(2, 11)]
    keep = streaming_keep(n, budget, BS).expand(H, -1)  # sinks filling page 0: it is whole too
    assert unchanged_pages(keep, n, BS).tolist() == [0, *range(2, 11)]


def test_eval_ppl_refuses_a_budget_it_would_not_apply(tmp_path, capsys, monkeypatch):
    import kvmesh.worker
    from kvmesh.cluster import cli

    def built(*a, **k):
        raise AssertionError("an engine was built before the flags were checked")

    monkeypatch.setattr(kvmesh.worker, "LLMEngine", built)
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert cli.main(["eval-ppl", "--text", str(text), "--kv-budget", "64"]) == 2
    assert "--kv-budget does not apply to eval-ppl" in capsys.readouterr().err
