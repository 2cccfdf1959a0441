"""A small Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Built for the fine-tuning job and the benchmarks: every preset uses the byte vocabulary
(``BYTE_VOCAB_SIZE``) so that any preset trains on byte-tokenized text. Weights are initialised
in ``__init__`` from the global torch RNG, so ``torch.manual_seed(s)`` before construction gives
the same model on every rank; shard it afterwards (``models.parallelize.apply_fsdp``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BYTE_VOCAB_SIZE", "PRESETS", "Llama", "LlamaConfig", "TransformerBlock"]

BYTE_VOCAB_SIZE = 264
"""The 256 byte values plus room for special tokens, rounded up to a multiple of 8."""

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of every linear and embedding weight."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a :class:`Llama` model. Cross-field constraints are checked on construction."""

    vocab_size: int = BYTE_VOCAB_SIZE
    """Number of token ids the embedding and the output head cover."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer; must divide ``dim``."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_hidden: int = 384
    """Hidden width of the SwiGLU feed-forward layer."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, not {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must divide dim ({self.dim}); "
                "choose a head count that divides the width"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                f"({self.n_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head dimension, found dim / n_heads = "
                f"{self.head_dim}; change dim or n_heads"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"LlamaConfig.rope_theta and norm_eps must be positive, found "
                f"{self.rope_theta} and {self.norm_eps}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    # Unit and end-to-end tests: a step takes milliseconds on one CPU core.
    "tiny": LlamaConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=128
    ),
    # The default fine-tuning run: a few hundred steps in about two minutes on two CPU ranks.
    "small": LlamaConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384, max_seq_len=256
    ),
    # Benchmarks: 12 layers of width 256 on the byte vocabulary (about 9.5M parameters).
    "12x256": LlamaConfig(
        dim=256, n_layers=12, n_heads=8, n_kv_heads=4, ffn_hidden=768, max_seq_len=512
    ),
    # GPU benchmarks: Llama-3.2-1B's layer shapes on the byte vocabulary (about 1B parameters).
    "1b": LlamaConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=2048,
        rope_theta=500000.0,
    ),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each of shape (max_seq_len, head_dim // 2)."""
    half = config.head_dim // 2
    freqs = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of ``x``'s last dim; x: (B, heads, T, head_dim)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then SwiGLU feed-forward. One FSDP unit."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only language model: ``forward(tokens[B, T]) -> logits[B, T, vocab_size]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rope_tables(config)
        # Derived from the config, so not part of the state dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: residual-branch output projections scaled by 1/sqrt(2 * n_layers).
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("wo", "w2")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)

    @property
    def num_params(self) -> int:
        """Number of parameter elements of the whole model (not of this rank's shards)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}; "
                "shorten the sequences or build the model with a larger max_seq_len"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
