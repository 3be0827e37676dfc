"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2) over a paged KV cache.

Parameter names equal Hugging Face's, so a checkpoint loads by name. The model sees one
flat batch of T tokens from many requests; attention goes through the backend, which owns
the cache layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels import cpu_ops
from kvmesh.kernels.cpu_linear import PackedLinear
from kvmesh.kernels.cpu_ops import rmsnorm_torch, rotary_torch, silu_mul_torch
from kvmesh.worker.attention import AttentionBackend, LayerCache
from kvmesh.worker.models.config import ModelConfig


def _bias(lin: nn.Linear) -> torch.Tensor | None:
    return lin.bias.data if lin.bias is not None else None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim/2,), with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor = rs["factor"]
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(is_medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # computed on the CPU even inside build_decoder's meta-device model: on the meta
        # device the ops would import torch._dynamo (~1.5 s a process) for a buffer replaced
        with torch.device("cpu"):
            inv = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos (T, 1, D) and a signed sin (T, 1, D): [-sin, sin] over the two halves."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        sin = emb.sin()
        sin[:, : freqs.shape[1]].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_torch(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=cfg.o_bias)
        self.scale = self.hd**-0.5
        self.qkv: PackedLinear | None = None
        self.o: PackedLinear | None = None

    def fuse(self) -> None:
        """Concatenate q/k/v into one weight after loading: one larger GEMM instead of three
        small ones (small-M GEMMs run far below peak on CPU)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([p.weight.data for p in projs])
        b = torch.cat([p.bias.data for p in projs]) if self.q_proj.bias is not None else None
        self.qkv = PackedLinear(w, b)
        self.o = PackedLinear(self.o_proj.weight.data, _bias(self.o_proj))
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, cache: LayerCache, backend: AttentionBackend):
        T = x.shape[0]
        if self.qkv is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        else:
            qkv = self.qkv(x)  # (T, (nh + 2 nkv) hd)
        n_qk = (self.nh + self.nkv) * self.hd
        qk = rotary_torch(qkv[:, :n_qk].view(T, self.nh + self.nkv, self.hd), cos, sin)
        q, k = qk[:, : self.nh], qk[:, self.nh :]  # (T, nh, hd), (T, nkv, hd)
        v = qkv[:, n_qk:].view(T, self.nkv, self.hd)  # (T, nkv, hd)
        o = backend.forward(q, k, v, cache, self.scale)  # (T, nh, hd)
        o = o.reshape(T, self.nh * self.hd)
        return self.o(o) if self.o is not None else self.o_proj(o)

    def forward_cpu(self, x, cos, sin, cache: LayerCache, backend: AttentionBackend, lib):
        """``forward`` with rotary applied in place on the fused qkv output, in C."""
        T = x.shape[0]
        qkv = self.qkv(x)  # (T, (nh + 2 nkv) hd), contiguous
        cpu_ops.rotary_cpu_(qkv, self.nh + self.nkv, self.hd, cos, sin, library=lib)
        n_q, n_qk = self.nh * self.hd, (self.nh + self.nkv) * self.hd
        q = qkv[:, :n_q].view(T, self.nh, self.hd)
        k = qkv[:, n_q:n_qk].view(T, self.nkv, self.hd)
        v = qkv[:, n_qk:].view(T, self.nkv, self.hd)
        o = backend.forward(q, k, v, cache, self.scale)  # (T, nh, hd)
        return self.o(o.reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.gate_up: PackedLinear | None = None
        self.down: PackedLinear | None = None

    def fuse(self) -> None:
        """Concatenate gate and up into one weight after loading (see Attention.fuse)."""
        w = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        b = None
        if self.gate_proj.bias is not None:
            b = torch.cat([self.gate_proj.bias.data, self.up_proj.bias.data])
        self.gate_up = PackedLinear(w, b)
        self.down = PackedLinear(self.down_proj.weight.data, _bias(self.down_proj))
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down(silu_mul_torch(self.gate_up(x)))

    def forward_cpu(self, x, lib):
        return self.down(cpu_ops.silu_mul_cpu(self.gate_up(x), library=lib))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``attention_cls`` is the one part that differs between the
    decoders built here (Llama's GQA ``Attention``, DeepSeek's ``MLAttention``)."""

    def __init__(self, cfg: ModelConfig, attention_cls: type[nn.Module] = Attention):
        super().__init__()
        self.self_attn = attention_cls(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, attention_cls: type[nn.Module], rotary_cls: type[nn.Module]
    ):
        super().__init__()
        # no random init: the weights are loaded (and on the meta device, where build_decoder
        # makes the model, normal_ alone would import torch._dynamo: ~2 s a process)
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(DecoderLayer(cfg, attention_cls) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = rotary_cls(cfg)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns logits (len(logit_indices), vocab) for the selected tokens only.
    A subclass swaps the attention and rotary modules (``worker/models/deepseek.py``)."""

    attention_cls: type[nn.Module] = Attention
    rotary_cls: type[nn.Module] = RotaryEmbedding

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.attention_cls, self.rotary_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head: PackedLinear | None = None
        self.cpu_kernels = None  # a kernels.cpu_native.CpuLibrary: fused elementwise ops in C

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up weights for inference. Call after loading the weights."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.head = PackedLinear(self.lm_head.weight.data)

    def set_gemm_tuner(self, tuner) -> None:
        """Every fused projection and the LM head pick their GEMMs with ``tuner`` (a
        ``kernels.autotune.GemmTuner``; the engine's choice of mode per KV cache format)."""
        for lin in self._packed():
            lin.use_tuner(tuner)

    def gemm_rows(self, max_tokens: int, max_seqs: int) -> list[tuple[PackedLinear, int]]:
        """Each GEMM layer and the most rows a step gives it: the projections up to the
        step's token budget, the LM head up to one row per sequence (for
        ``kernels.cpu_linear.warm_up``)."""
        head = min(max_tokens, max_seqs)
        return [(lin, head if lin is self.head else max_tokens) for lin in self._packed()]

    def _packed(self) -> list[PackedLinear]:
        out = [self.head] if self.head is not None else []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            out += [x for x in (a.qkv, a.o, m.gate_up, m.down) if x is not None]
        return out

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        caches: list[LayerCache],  # one per layer: views into the page pool
        backend: AttentionBackend,
        logit_indices: torch.Tensor,  # (S,) indices into the T tokens
    ) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = m.rotary_emb(positions, x.dtype)
        if self._cpu_path(x):
            x = self._layers_cpu(x, cos, sin, caches, backend)
        else:
            for i, layer in enumerate(m.layers):
                x = layer(x, cos, sin, caches[i], backend)
        x = m.norm(x[logit_indices])  # (S, hidden)
        logits = self.head(x) if self.head is not None else self.lm_head(x)
        return logits.float()  # (S, vocab)

    def _cpu_path(self, x: torch.Tensor) -> bool:
        fused = self.head is not None
        return self.cpu_kernels is not None and fused and x.dtype == torch.float32 and x.is_cpu

    def _layers_cpu(self, x, cos, sin, caches, backend) -> torch.Tensor:
        """The decoder layers with their elementwise ops fused in C: the residual stream x
        (T, hidden) is updated in place, and each residual add is fused with the RMSNorm
        that follows it. Same math and order as ``DecoderLayer.forward``."""
        lib, layers = self.cpu_kernels, self.model.layers
        norm = layers[0].input_layernorm
        h = cpu_ops.rmsnorm_cpu(x, norm.weight, norm.eps, library=lib)
        for i, layer in enumerate(layers):
            a = layer.self_attn.forward_cpu(h, cos, sin, caches[i], backend, lib)
            norm = layer.post_attention_layernorm
            h = cpu_ops.add_rmsnorm_cpu(x, a, norm.weight, norm.eps, library=lib)
            mlp_out = layer.mlp.forward_cpu(h, lib)
            if i + 1 < len(layers):
                norm = layers[i + 1].input_layernorm
                h = cpu_ops.add_rmsnorm_cpu(x, mlp_out, norm.weight, norm.eps, library=lib)
            else:
                x += mlp_out
        return x


def build_model(
    cfg: ModelConfig, src, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model of ``cfg`` with the weights of ``src`` (a ``loader.ModelSource``), fused
    for inference, in eval mode."""
    model = build_decoder(LlamaForCausalLM, cfg, src, dtype, device, rope_inv_freq(cfg))
    model.fuse_projections()
    return model


def build_decoder(
    model_cls: type[LlamaForCausalLM],
    cfg: ModelConfig,
    src,
    dtype: torch.dtype,
    device: torch.device,
    inv_freq: torch.Tensor,
) -> LlamaForCausalLM:
    """``model_cls(cfg)`` strictly loaded from ``src``, in eval mode. Built on the meta
    device first: no weight is allocated twice."""
    from kvmesh.worker.models.loader import load_weights

    with torch.device("meta"):
        model = model_cls(cfg)
    model = model.to_empty(device=device).to(dtype)
    # buffers made on the meta device hold garbage after to_empty; rope stays float32
    model.model.rotary_emb.inv_freq = inv_freq.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, src, dtype)
    return model.eval()
