"""Engine arguments are validated before the model loads, naming the bad value."""

import pytest

from kvmesh.worker import LLMEngine


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(block_size=12), "block_size"),
        (dict(kv_cache_memory="lots"), "invalid size"),
        (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
        (dict(dtype="float8"), "dtype"),
    ],
)
def test_bad_engine_args_fail_before_loading(kwargs, needle, monkeypatch):
    import kvmesh.worker.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(engine_mod, "load_config", no_load)
    with pytest.raises(ValueError, match=needle):
        LLMEngine("smollm2-135m-instruct", **kwargs)
