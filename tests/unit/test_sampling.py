"""SamplingParams validation and the sampler: greedy, seeds, top-k, top-p, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.worker.request import Request
from kvmesh.worker.sampler import sample
from kvmesh.worker.sampling_params import SamplingParams

V = 50


def make_req(rid: str = "r", **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), 4, "test-fp")


def make_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3  # (S, V) float32


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"logprobs": 1}, "logprobs"),
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accept_and_normalise_good_values():
    p = SamplingParams(
        max_tokens=1, temperature=0.0, top_k=-1, top_p=1.0, stop="END", stop_token_ids=[2]
    )
    assert p.stop == ("END",)
    assert p.stop_token_ids == (2,)
    assert p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(top_k=0, top_p=1e-9, seed=0).top_k == 0
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # frozen


@pytest.mark.parametrize(
    "temperature, greedy", [(0.0, True), (1e-40, True), (9.9e-6, True), (1e-5, False), (0.5, False)]
)
def test_temperature_below_vllm_epsilon_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_cache_salt_is_kept_out_of_repr_and_empty_means_none():
    p = SamplingParams(cache_salt="tenant-secret")
    assert p.cache_salt == "tenant-secret"
    assert "tenant-secret" not in repr(p)
    assert SamplingParams(cache_salt="").cache_salt is None


# ---------------------------------------------------------------- sampler


def test_greedy_is_argmax_and_no_logprobs_unless_asked():
    logits = make_logits(5)
    reqs = [make_req(f"r{i}", temperature=0.0) for i in range(5)]
    tokens, lps, _ = sample(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_a_tiny_temperature_samples_the_argmax_instead_of_overflowing():
    # 1e-40 passed validation before and crashed the engine loop: logits / 1e-40 is inf
    logits = make_logits(3, seed=5)
    reqs = [make_req(f"r{i}", temperature=1e-40, seed=i) for i in range(3)]
    tokens, _, errors = sample(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()
    assert errors == [None] * 3


def test_a_row_that_cannot_be_sampled_fails_only_its_request():
    logits = make_logits(4, seed=6)
    logits[1, 7] = float("nan")  # non-finite logits (greedy would silently pick the NaN)
    logits[2] = float("-inf")  # a distribution with no mass: multinomial raises
    reqs = [
        make_req("ok-greedy", temperature=0.0),
        make_req("nan", temperature=0.0),
        make_req("no-mass", temperature=0.8, seed=1),
        make_req("ok-sampled", temperature=0.8, seed=2, logprobs=True),
    ]
    tokens, lps, errors = sample(logits, reqs)
    assert tokens[0] == int(logits[0].argmax())
    assert errors[0] is None and errors[3] is None
    assert 0 <= tokens[3] < V and lps[3] is not None
    assert tokens[1] == tokens[2] == -1
    assert "non-finite" in errors[1]
    assert "non-finite" in errors[2]  # -inf everywhere is caught before the draw


def test_any_single_non_finite_logit_fails_its_row_and_greedy_takes_the_first_maximum():
    """The sampler's finiteness check (a row's max and min) against torch.isfinite: one
    +inf, -inf or NaN at the row's start, middle or end fails that row alone; a greedy row
    with tied maxima takes the first, as argmax does."""
    n_rows = 10
    logits = make_logits(n_rows, seed=9)
    bad = [(1, 0, float("inf")), (2, V // 2, float("-inf")), (3, V - 1, float("nan"))]
    bad += [(4, 0, float("nan")), (5, V - 1, float("inf")), (6, 3, float("-inf"))]
    for row, col, value in bad:
        logits[row, col] = value
    logits[7, 5] = logits[7, 11] = float(logits[7].max()) + 1  # tie: the first wins
    reqs = [make_req(f"r{i}", temperature=0.0) for i in range(n_rows)]
    tokens, _, errors = sample(logits, reqs)
    ok = torch.isfinite(logits).all(-1).tolist()
    assert [e is None for e in errors] == ok == [True] + [False] * 6 + [True] * 3
    assert [t for t, good in zip(tokens, ok) if good] == [
        int(logits[i].argmax()) for i in range(n_rows) if ok[i]
    ]
    assert tokens[7] == 5 and tokens[1:7] == [-1] * 6


def test_a_failed_draw_is_reported_not_raised(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(torch, "multinomial", boom)
    reqs = [make_req("a", temperature=0.7, seed=1), make_req("b", temperature=0.0)]
    logits = make_logits(2, seed=9)
    tokens, _, errors = sample(logits, reqs)
    assert tokens == [-1, int(logits[1].argmax())]
    assert errors[0].startswith("sampling failed") and errors[1] is None


def _draws(make, logits_row: torch.Tensor, n: int = 30) -> list[int]:
    req = make()
    return [sample(logits_row[None], [req])[0][0] for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_ignores_global_rng():
    row = make_logits(1)[0] / 3  # flatter, so draws vary
    torch.manual_seed(1)
    a = _draws(lambda: make_req(seed=1234), row)
    torch.manual_seed(2)
    b = _draws(lambda: make_req(seed=1234), row)
    c = _draws(lambda: make_req(seed=4321), row)
    assert a == b
    assert a != c
    assert len(set(a)) > 3  # it really samples


def test_seeded_sampling_is_independent_of_batch_composition():
    logits = make_logits(4, seed=3)
    alone_req = make_req("alone", seed=99, top_k=20, top_p=0.95, temperature=0.8)
    alone = [sample(logits[2:3], [alone_req])[0][0] for _ in range(25)]

    target = make_req("t", seed=99, top_k=20, top_p=0.95, temperature=0.8)
    others = [
        make_req("u", temperature=1.0),  # global RNG
        make_req("s", seed=5, temperature=1.3),
        make_req("g", temperature=0.0, logprobs=True),
    ]
    batched = []
    for _ in range(25):
        toks, _, _ = sample(logits, [others[0], others[1], target, others[2]])
        batched.append(toks[2])
    assert batched == alone


def test_top_k_one_equals_greedy():
    logits = make_logits(16, seed=7)
    reqs = [make_req(f"r{i}", temperature=1.5, top_k=1, seed=i) for i in range(16)]
    for _ in range(3):
        tokens, _, _ = sample(logits, reqs)
        assert tokens == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = make_logits(16, seed=8)
    reqs = [make_req(f"r{i}", temperature=2.0, top_p=1e-6, seed=i) for i in range(16)]
    for _ in range(3):
        tokens, _, _ = sample(logits, reqs)
        assert tokens == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_most_likely():
    row = torch.arange(10, dtype=torch.float32) * 0.1  # nearly flat; top 3 are 7, 8, 9
    seen = set(_draws(lambda: make_req(seed=0, top_k=3), row, n=200))
    assert seen == {7, 8, 9}


@pytest.mark.parametrize("top_p, allowed", [(0.7, {0, 1}), (0.85, {0, 1, 2}), (0.5, {0})])
def test_top_p_keeps_the_smallest_nucleus(top_p, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probs.log()
    seen = set(_draws(lambda: make_req(seed=0, top_p=top_p), row, n=300))
    assert seen == allowed


def test_logprobs_are_raw_log_softmax_at_the_chosen_token():
    logits = make_logits(4, seed=11)
    reqs = [
        make_req("g", temperature=0.0, logprobs=True),
        make_req("t", temperature=0.5, top_k=5, seed=1, logprobs=True),
        make_req("p", temperature=2.0, top_p=0.5, seed=2, logprobs=True),
        make_req("n", temperature=1.0, seed=3),
    ]
    raw = torch.log_softmax(logits.double(), dim=-1)
    tokens, lps, _ = sample(logits, reqs)
    for i in range(3):
        assert lps[i] == pytest.approx(float(raw[i, tokens[i]]), abs=1e-5)
        assert lps[i] < 0
    assert lps[3] is None
    # not the log-prob after temperature/top-k: a filtered distribution would differ
    scaled = torch.log_softmax(logits[1] / 0.5, dim=-1)[tokens[1]]
    assert not math.isclose(lps[1], float(scaled), abs_tol=1e-3)


def test_a_vanishing_top_p_still_keeps_the_most_likely_token():
    # cumsum rounding left a mass of ~1e-8 "before" the first token, which a top_p of 1e-300
    # dropped too: every logit became -inf and the draw failed (found by the fuzz test)
    logits = make_logits(8, seed=12)
    reqs = [make_req(f"r{i}", temperature=1.0, top_p=1e-300, seed=i) for i in range(8)]
    tokens, _, errors = sample(logits, reqs)
    assert errors == [None] * 8
    assert tokens == logits.argmax(-1).tolist()
