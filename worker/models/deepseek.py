"""DeepSeek-V2/V3 decoder with multi-head latent attention (MLA) over latent KV pages.

MLA compresses each token's keys and values into one shared latent ``c_kv`` (kv_lora_rank
values, after ``kv_a_layernorm``) plus one rotary key ``k_pe`` shared by every head
(qk_rope_head_dim values). The page pool stores exactly that row per token and layer
(``PageLayout(attention="mla")``); the per-head keys and values are never cached. The
up-projection ``kv_b_proj`` (H * (nope + v), rank) is split into W_UK (H, nope, rank) and
W_UV (H, v, rank), which the attention backend (``worker/attention/mla.py``) absorbs into
the query and the output for decode.

Parameter names equal Hugging Face's ``DeepseekV3ForCausalLM`` (and V2's for dense layers),
so a checkpoint loads by name. Mixture-of-experts layers are refused by ``ModelConfig``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvmesh.worker.attention import AttentionBackend, LayerCache
from kvmesh.worker.models.config import ModelConfig
from kvmesh.worker.models.llama import LlamaForCausalLM, RMSNorm, build_decoder

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not the config's


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies (qk_rope_head_dim/2,) and the factor cos and sin are
    multiplied by (YaRN's attention factor; 1 without scaling)."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", "default") != "yarn":
        return 1.0 / pos_freqs, 1.0
    # ModelConfig normalised these: factor present, original length defaulted
    orig, factor = rs["original_max_position_embeddings"], rs["factor"]
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    attn = rs.get("attention_factor")
    if attn is None:
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(nope + rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", "default") == "yarn" and rs.get("mscale_all_dim"):
        m = _yarn_mscale(rs["factor"], rs["mscale_all_dim"])
        scale *= m * m
    return scale


class MLARotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        with torch.device("cpu"):  # not on the meta device: see llama.RotaryEmbedding
            inv, self.attention_factor = mla_rope(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin (T, 1, rope/2), YaRN's attention factor applied."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, rope/2)
        f = self.attention_factor
        return (freqs.cos() * f).to(dtype)[:, None, :], (freqs.sin() * f).to(dtype)[:, None, :]


def mla_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """x (T, h, rope) -> rotated (T, h, rope), in the two-halves layout either way:
    interleaved weights pair (x0, x1), (x2, x3), ...; the others (x_i, x_{i + rope/2})."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, self.nh = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.nh * qk, bias=False)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, h, bias=cfg.o_bias)
        self.scale = mla_softmax_scale(cfg)
        self.interleave = cfg.rope_interleave

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, nope, rank) and W_UV (H, v, rank): views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.nh, self.nope + self.vd, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, cos, sin, cache: LayerCache, backend: AttentionBackend):
        T = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(T, self.nh, self.nope + self.rope)
        q_nope, q_pe = (
            q[..., : self.nope],
            mla_rotate(q[..., self.nope :], cos, sin, self.interleave),
        )
        ckv = self.kv_a_proj_with_mqa(x)  # (T, rank + rope)
        c = self.kv_a_layernorm(ckv[:, : self.rank])  # (T, rank)
        k_pe = mla_rotate(ckv[:, None, self.rank :], cos, sin, self.interleave)[:, 0]  # (T, rope)
        latent = torch.cat((c, k_pe), dim=-1)  # (T, rank + rope): the cached row
        w_uk, w_uv = self.up_weights()
        o = backend.forward_mla(
            q_nope, q_pe, latent, cache, w_uk=w_uk, w_uv=w_uv, scale=self.scale
        )  # (T, H, v)
        return self.o_proj(o.reshape(T, self.nh * self.vd))


class DeepseekForCausalLM(LlamaForCausalLM):
    """Llama's decoder shell (pre-norm blocks, dense MLP, tied or untied head) with MLA
    attention and DeepSeek's rotary. It is never fused and never takes the C layer path
    (``cpu_kernels`` stays None: the engine loads the C kernels for Llama models only).
    The backend must offer ``forward_mla`` (``worker.attention.mla.MLABackend``)."""

    attention_cls = MLAttention
    rotary_cls = MLARotary

    def _packed(self) -> list:
        return []  # never fused: its projections stay nn.Linear, no GEMM tuner applies


def build_deepseek(
    cfg: ModelConfig, src, dtype: torch.dtype, device: torch.device
) -> DeepseekForCausalLM:
    """The model of ``cfg`` with the weights of ``src``, strictly loaded, in eval mode."""
    return build_decoder(DeepseekForCausalLM, cfg, src, dtype, device, mla_rope(cfg)[0])
