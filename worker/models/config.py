"""The architecture of a Llama-family decoder, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # multi-head latent attention (DeepSeek-V2/V3; see worker/models/deepseek.py). For these
    # num_kv_heads == num_heads and head_dim is the query/key head size (nope + rope)
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: a plain q_proj (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek's weights

    @property
    def is_mla(self) -> bool:
        return self.architecture in MLA_ARCHITECTURES

    def page_layout(self, cache_format: str, block_size: int):
        """The ``kernels.page_format.PageLayout`` of this model's KV pages."""
        from kvmesh.kernels.page_format import PageLayout

        if self.is_mla:
            return PageLayout(
                cache_format,
                self.num_layers,
                1,
                self.kv_lora_rank + self.qk_rope_head_dim,
                block_size,
                attention="mla",
                rope_dim=self.qk_rope_head_dim,
            )
        return PageLayout(
            cache_format, self.num_layers, self.num_kv_heads, self.head_dim, block_size
        )

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        if self.is_mla:
            self._check_mla()
            return
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rt = (self.rope_scaling or {}).get("rope_type", "default")
        if rt not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {rt!r}; supported: default, linear, llama3")

    def _check_mla(self) -> None:
        dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            dims += ("q_lora_rank",)
        for name in dims:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.architecture}: {name} must be an integer >= 1, got {v!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError("head_dim of an MLA model is qk_nope_head_dim + qk_rope_head_dim")
        rt = (self.rope_scaling or {}).get("rope_type", "default")
        if rt not in ("default", "yarn"):
            raise ValueError(
                f"unsupported rope scaling {rt!r} for {self.architecture}; supported: default, yarn"
            )
        if rt == "yarn":  # normalised once here; models.deepseek reads these keys as they are
            rs = dict(self.rope_scaling)
            if rs.get("factor") is None:
                raise ValueError("rope_scaling.factor is required for yarn")
            # as transformers: without it, the pretrained length is max_position_embeddings
            rs.setdefault("original_max_position_embeddings", self.max_position_embeddings)
            object.__setattr__(self, "rope_scaling", rs)
        if self.sliding_window is not None:
            raise ValueError(f"{self.architecture} has no sliding window")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            mt = cfg.get("model_type")
            if mt not in SUPPORTED_ARCHITECTURES.values():
                raise ValueError(
                    f"unsupported model: architectures={archs} model_type={mt!r}; kvmesh runs "
                    f"{sorted(SUPPORTED_ARCHITECTURES)}"
                )
            arch = mt
        if arch in MLA_ARCHITECTURES:
            return cls._from_deepseek_dict(arch, cfg)
        heads = cfg["num_attention_heads"]
        rope, theta = _hf_rope(cfg)
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = _hf_eos(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding,
            rope_scaling=rope or None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def _from_deepseek_dict(cls, arch: str, cfg: dict[str, Any]) -> ModelConfig:
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("n_routed_experts") or 0
        dense = cfg.get("first_k_dense_replace") or 0
        # as transformers' DeepseekV2/V3 models: every layer from first_k_dense_replace on is
        # a mixture of experts; moe_layer_freq is not read (nor is it by transformers)
        moe_layers = [i for i in range(layers) if experts and i >= dense]
        if moe_layers:
            raise ValueError(
                f"{arch}: mixture-of-experts layers {moe_layers[:8]} (n_routed_experts="
                f"{experts}, first_k_dense_replace={dense}) are not supported; kvmesh runs "
                f"DeepSeek models with dense MLP layers only (first_k_dense_replace >= "
                f"num_hidden_layers={layers}, or n_routed_experts null)"
            )
        rope, theta = _hf_rope(cfg)
        heads = cfg["num_attention_heads"]
        nope, rot = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        eos = _hf_eos(cfg)
        bias = bool(cfg.get("attention_bias", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act {cfg.get('hidden_act')!r}; kvmesh runs silu")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rot,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            rope_scaling=rope or None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            kv_lora_rank=cfg["kv_lora_rank"],
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rot,
            v_head_dim=cfg["v_head_dim"],
            # DeepSeek-V2's transformers code rotates interleaved pairs; V3 has a flag
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )

    @classmethod
    def from_json_file(cls, path: Path) -> ModelConfig:
        try:
            cfg = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from e
        try:
            return cls.from_hf_dict(cfg)
        except KeyError as e:
            raise ValueError(f"model config {path} lacks required field {e}") from e


def _hf_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """A config.json's rope scaling (``rope_parameters`` or ``rope_scaling``, ``type`` read as
    ``rope_type``; empty for the default rope) and rope theta."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type", "default") == "default":
        rope = {}
    return rope, float(theta)


def _hf_eos(cfg: dict[str, Any]) -> tuple[int, ...]:
    """A config.json's eos_token_id (one id, a list, or none) as a tuple."""
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
