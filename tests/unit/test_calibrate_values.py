"""calibrate-profile's check of what it measured: a tier load within noise of a device hit
is 0 (free), anything else that is not a positive finite number is a clear error."""

from __future__ import annotations

import math

import pytest

from kvmesh.cluster.calibrate import CalibrationError, check_measured


def _values(**kw):
    v = dict(
        prefill_tokens_per_s=300.0,  # recompute: 3.3 ms a token
        decode_s_per_token=0.08,
        host_s_per_token=20e-6,
        redis_s_per_token=70e-6,
    )
    v.update(kw)
    return v


def test_positive_values_pass_unchanged():
    v = _values()
    check_measured(v)
    assert v == _values()


@pytest.mark.parametrize("host", [-3.6e-6, 0.0, -100e-6])
def test_a_host_load_within_noise_of_a_device_hit_is_free(host):
    v = _values(host_s_per_token=host)
    lines = []
    check_measured(v, lines.append)
    assert v["host_s_per_token"] == 0.0
    assert v["redis_s_per_token"] == 70e-6
    assert any("host_s_per_token" in line for line in lines)


@pytest.mark.parametrize(
    "bad",
    [
        dict(host_s_per_token=-1e-3),  # a device hit far slower than a host load: broken
        dict(redis_s_per_token=math.nan),
        dict(decode_s_per_token=0.0),
        dict(prefill_tokens_per_s=-1.0),
    ],
)
def test_a_broken_measurement_is_an_error_naming_it(bad):
    with pytest.raises(CalibrationError, match=next(iter(bad))):
        check_measured(_values(**bad))
