"""worker.config: sizes, dtypes and the self-validating config dataclasses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.worker.config import CacheConfig, SchedulerConfig, parse_size, resolve_dtype


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 1_610_612_736),
        ("64KiB", 65_536),
        ("64KB", 64_000),
        ("64k", 64_000),
        ("3Ki", 3072),
        ("1T", 10**12),
        ("1TiB", 1024**4),
        ("2gib", 2 * 1024**3),
        (" 2 GiB ", 2 * 1024**3),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        (2048, 2048),
        (0, 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2.01KB", 2010),
        ("8.12KB", 8120),
        ("2.01MB", 2_010_000),
        ("4.35MB", 4_350_000),
        ("0.1GB", 100_000_000),
    ],
)
def test_parse_size_decimal_sizes_are_exact(text, expected):
    # a decimal size that is a whole number of bytes must not lose a byte to binary floats
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "GiB", "2XB", "-1GiB", "2 GiB extra", "two", "1,5GB", "2GiBB", -1, True]
)
def test_parse_size_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("fp32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    expected_auto = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert resolve_dtype("auto") is expected_auto
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        resolve_dtype("int3")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(torch.int8)


def test_cache_config_defaults_and_frozen():
    c = CacheConfig()
    assert (c.block_size, c.kv_cache_dtype, c.enable_prefix_caching) == (16, "auto", True)
    assert c.kv_residual_pages == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"kv_cache_dtype": "int5"}, "kv_cache_dtype"),
        ({"num_pages": 1}, "num_pages"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"kv_residual_pages": 0}, "kv_residual_pages"),
        ({"kv_residual_pages": 65}, "kv_residual_pages"),
        ({"kv_residual_pages": 2.0}, "kv_residual_pages"),
        ({"kv_residual_pages": True}, "kv_residual_pages"),
    ],
)
def test_cache_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("block_size", [1, 2, 16, 256])
def test_cache_config_accepts_powers_of_two(block_size):
    assert CacheConfig(block_size=block_size, num_pages=2).block_size == block_size


@pytest.mark.parametrize(
    "name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting"]
)
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_scheduler_config_rejects(name, value):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: value})


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.5", None])
def test_scheduler_config_rejects_a_preemption_reserve_outside_0_to_1(value):
    with pytest.raises(ValueError, match="preemption_reserve"):
        SchedulerConfig(preemption_reserve=value)
