"""A compact Llama / Qwen2 / Qwen3 decoder that runs on flat token batches through the paged KV cache.

One forward handles any mix of sequences: each contributes some new tokens (a prefill chunk, one
decode token, or the tokens to verify after speculation). Linear layers run on the flat
``[T, hidden]`` tokens; attention runs through the model's attention backend
(:mod:`backend.model.attention`), which reads each sequence's cached K/V through its block table.

Weights are stored fused (``qkv_proj`` = q, k, v stacked; ``gate_up_proj`` = gate, up stacked) to
run fewer, larger matmuls; :mod:`backend.loader` maps Hugging Face checkpoints onto this layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.attention import AttentionBackend, AttentionMetadata, get_backend
from backend.model.kv_cache import PagedKVCache
from backend.model.linear import Linear, linear
from backend.model.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:     # one fused op (the same arithmetic)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32, scale in the model dtype (as the reference implementations do).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


# ---- rotary position embedding ------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale for ``config``."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated (divided by factor), short ones kept, and the band in
        # between blended smoothly.
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(middle, blended, out), 1.0
    if kind == "yarn":
        factor = scaling["factor"]
        old_len = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1
        attn_factor = scaling.get("attention_factor")
        if attn_factor is None:
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

            def get_mscale(m: float = 1.0) -> float:
                return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

            if mscale and mscale_all:
                attn_factor = get_mscale(mscale) / get_mscale(mscale_all)
            else:
                attn_factor = get_mscale()

        def correction_dim(rotations: float) -> float:
            # dimension index whose wavelength fits ``rotations`` times in the original context
            wavelength_fraction = old_len / (rotations * 2 * math.pi)
            return dim * math.log(wavelength_fraction) / (2 * math.log(config.rope_theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, device="cpu").float() - lo) / (hi - lo)).clamp(0, 1)
        # ramp 0 -> keep the original frequency (extrapolate), 1 -> interpolate (divide by factor)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attn_factor)
    raise ValueError(
        f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def rope_table(config: ModelConfig) -> torch.Tensor:
    """``[max_position_embeddings, head_dim // 2, 2]`` float32: (cos, sin) per frequency."""
    inv_freq, scale = rope_inv_freq(config)
    t = torch.arange(config.max_position_embeddings, device="cpu").float()
    freqs = t[:, None] * inv_freq[None, :]
    return torch.stack((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``, whose dims come in pairs (the loader interleaves
    HF's rotate-half halves), by ``rot`` ``[T, 1, head_dim/2, 2]`` (cos, sin): one complex
    multiply in float32, the same arithmetic as rotate-half."""
    T, H, d = x.shape
    pairs = x.view(T, H, d // 2, 2)
    # Eager: one complex multiply. Compiled: the real form, which the compiler fuses (it has no
    # code generation for complex numbers).
    if x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(rot)).view(T, H, d)
    a, b = pairs.unbind(-1)
    cos, sin = rot.unbind(-1)
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).view(T, H, d)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d = config.head_dim
        self.scale = d**-0.5
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * d
        self.qkv_proj = Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        # Llama and Qwen3 put a bias on o_proj too when attention_bias is set; Qwen2 never does.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = Linear(config.num_heads * d, config.hidden_size, bias=o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, rot, meta, kv_cache, layer):
        T = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)
        qk = qkv[:, : (h + kvh) * d].view(T, h + kvh, d)
        v = qkv[:, (h + kvh) * d :].view(T, kvh, d)
        if self.qk_norm:
            qk = torch.cat((self.q_norm.forward(qk[:, :h]), self.k_norm.forward(qk[:, h:])), dim=1)
        qk = apply_rope(qk, rot)  # q and k heads rotated together
        out = self.backend.attend(qk[:, :h], qk[:, h:], v, kv_cache, layer, meta, self.scale)
        return self.o_proj.forward(out.reshape(T, h * d))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rot, meta, kv_cache, layer):
        # Submodules' forward() called directly: nn.Module.__call__ costs a few microseconds,
        # paid about a hundred times per forward of a small model.
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rot, meta, kv_cache, layer)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attention: str | AttentionBackend = "sdpa", device="cpu"):
        super().__init__()
        self.config = config
        self.attention = get_backend(attention, device)      # also builds each forward's metadata
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.attention) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models read the output projection from embed_tokens.weight.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # (cos, sin) for every position, computed once. Not persistent: derived from the config.
        # Kept in float32 (the complex multiply needs it); cast per forward for other dtypes, as
        # the reference casts cos/sin to the model dtype before use.
        self.register_buffer("rope_cache", rope_table(config), persistent=False)

    def prepare(self, kv_cache: PagedKVCache, seq_ids: list, num_cached: list[int],
                num_new: list[int], lookahead: int = 0) -> AttentionMetadata:
        """The metadata of one forward (see :class:`~backend.model.attention.AttentionBackend`)."""
        return self.attention.prepare(kv_cache, seq_ids, num_cached, num_new, lookahead)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[N, vocab]`` (float32) for the flat tokens ``input_ids`` ``[T]``, at
        ``logits_indices`` ``[N]`` (None: all T tokens). `kv` is the KV cache's storage
        (``PagedKVCache.kv``); `meta` whatever the attention backend reads (its metadata, or for
        a compiled step the same tensors without the Python-side fields)."""
        x = self.embed_tokens(input_ids)
        rot = self.rope_cache[meta.positions].unsqueeze(1)
        if x.dtype != torch.float32:
            rot = rot.to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, rot, meta, kv, i)
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm.forward(x)
        logits = linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head.forward(x)
        return logits if logits.dtype == torch.float32 else logits.float()
