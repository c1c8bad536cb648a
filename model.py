"""A Llama-style transformer that can predict several tokens per forward pass.

Multi-token prediction (MTP) by self-distillation adds no heads: one new `<mask>`
token, and feeding `prefix <mask> <mask> ...` asks the unchanged network for the
next few tokens at once. The block is Llama's, x += Attention(RMSNorm(x)) and
x += SwiGLU(RMSNorm(x)), with RoPE, grouped-query attention (GQA), optional q/k
norms (Qwen3) and tied embeddings.

`Transformer.forward` serves training and decoding alike. Training gives explicit
positions and any boolean mask (data.py's packed layout). Decoding gives a `cache`:
each layer hands its keys and values to `cache.attend`, which stores them and
attends over all it holds. The `KVCache` at the end of this file writes each token
at an explicit slot and attends causally by slot, so a decoder rolls mask slots
back and the next pass overwrites them. The engine's ragged passes (mtp/engine.py)
and the gated adapter's training pass (adapter.py) are caches of their own with the
same `attend`. mtp/hf.py reads and writes Llama-3.x, Qwen3 and Qwen2 checkpoints in
Hugging Face layout.

References: Llama 3 (arXiv 2407.21783), Qwen3 (2505.09388), RoFormer (2104.09864),
GQA (2305.13245), GLU variants (2002.05202), Multi-Token Prediction via
Self-Distillation (2602.06019).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# Llama-3.x, Qwen3, Qwen2 (mtp/hf.py reads and writes their checkpoints)
MODEL_TYPES = ("llama", "qwen3", "qwen2")


@dataclass
class ModelConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    # None: dim // n_heads (Qwen3 sets it explicitly)
    head_dim: int | None = None
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    rope_scaling: dict | None = None
    # Qwen3: RMSNorm over each head of q and k before RoPE
    qk_norm: bool = False
    # Qwen2: biases on the q/k/v projections
    attn_bias: bool = False
    # the output matrix is the embedding matrix
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    # one of MODEL_TYPES (names the HF architecture)
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # set by add_mask_token
    mask_token_id: int | None = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model type {self.model_type!r}; "
                             f"supported: {', '.join(MODEL_TYPES)}")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight
    (as Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation frequency of each channel pair, (head_dim // 2,). Llama 3.1 scaling
    slows the wavelengths over original_max / low by `factor`, keeps those under
    original_max / high, and blends the ones between."""
    hd = cfg.head_dim
    exponents = torch.arange(0, hd, 2, dtype=torch.float64) / hd
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq.float()

    factor = scaling["factor"]
    low = scaling["low_freq_factor"]
    high = scaling["high_freq_factor"]
    original_max = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # s: 0 at the long end, 1 at the short end
    s = ((original_max / wavelen) - low) / (high - low)
    smoothed = (1 - s) * inv_freq / factor + s * inv_freq
    scaled = torch.where(wavelen > original_max / low, inv_freq / factor, smoothed)
    return torch.where(wavelen < original_max / high, inv_freq, scaled).float()


def apply_rope(x, cos, sin):
    """Rotate channel i with channel i + head_dim/2 (the 'rotate_half' layout of
    Hugging Face checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q, k, v, mask):
    """softmax(q k^T / sqrt(hd) + mask) v for q (B, H, T, hd), k and v (B, n_kv, S, hd);
    mask None (causal), bool (..., T, S), or kernel_mask's (a pass builds it once for
    all its layers). Masked kernels may lack GQA (torch falls back to float32
    (B, H, T, S) scores), so the g query heads of a K/V head become g * T query rows
    of it."""
    B, H, T, hd = q.shape
    n_kv = k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != n_kv)

    g = H // n_kv
    # query head h = kv * g + j becomes row j * T + t of K/V head kv
    q = q.reshape(B, n_kv, g * T, hd)
    if mask.dtype == torch.bool:
        mask = kernel_mask(mask, g, q.dtype)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)    # (B, n_kv, g * T, hd)
    # reshape, not view: CUDA's memory-efficient kernel returns y transposed, laid
    # out as (B, g * T, n_kv, hd), and that layout cannot be split into
    # (B, H, T, hd) without a copy.
    return y.reshape(B, H, T, hd)


def kernel_mask(mask, g: int, dtype):
    """A bool mask (..., T, S) as attend hands it to the kernel: repeated for the g
    query heads of a K/V head, and in q's dtype, 0 where attending, -inf elsewhere
    (what the kernel makes of a bool mask)."""
    T, S = mask.shape[-2:]
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], g, T, S)
    mask = mask.flatten(-3, -2)                                    # (..., g * T, S)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


class Linear(nn.Linear):
    """nn.Linear that may carry a gated mask adapter (adapter.py), applied at mask_rows only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter = None

    def forward(self, x, mask_rows=None):
        """y = W x for x (..., d_in); an adapter adds its update at mask_rows, rows of
        x.flatten(0, -2)."""
        y = super().forward(x)
        if self.adapter is None or mask_rows is None:
            return y
        return self.adapter(x, y, mask_rows)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        # where a KV cache keeps this layer's keys and values
        self.layer = layer
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        q_dim = cfg.n_heads * cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = Linear(cfg.dim, q_dim, bias=cfg.attn_bias)
        self.wk = Linear(cfg.dim, kv_dim, bias=cfg.attn_bias)
        self.wv = Linear(cfg.dim, kv_dim, bias=cfg.attn_bias)
        self.wo = Linear(q_dim, cfg.dim, bias=False)
        self.q_norm = None
        self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask=None, mask_rows=None, cache=None):
        """mask: None (causal) or bool, (T, T) or (B, 1, T, T). cache: a KV cache,
        which stores this layer's keys and values and attends over all it holds."""
        B, T, _ = x.shape
        q = self.wq(x, mask_rows).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x, mask_rows).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x, mask_rows).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Qwen3: a norm over each head, before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)      # (B, n_heads, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)      # (B, n_kv_heads, T, hd)
        v = v.transpose(1, 2)

        if cache is None:
            y = attend(q, k, v, mask)
        else:
            y = cache.attend(self.layer, q, k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.wo(y, mask_rows)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, mask_rows=None):
        hidden = F.silu(self.gate(x, mask_rows)) * self.up(x, mask_rows)
        return self.down(hidden, mask_rows)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, mask=None, mask_rows=None, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, mask_rows, cache)
        return x + self.mlp(self.mlp_norm(x), mask_rows)


def slots_of(is_mask):
    """(B, T) bool -> (B, T): at each True, 1 + the Trues just before it in its row."""
    T = is_mask.shape[1]
    index = torch.arange(T, device=is_mask.device)
    # the last ordinary position at or before each one (-1: none)
    last = torch.where(is_mask, -1, index).cummax(dim=1).values
    return index - last


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # the gated mask adapter's <mask> input (adapter.add_mask_adapter)
        self.mask_embedding = None
        # GPT-2's initialisation
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def _apply(self, fn, *args, **kwargs):
        """.to(), .cuda(), .bfloat16() ... move the RoPE frequencies but never round
        them: in bfloat16 a position's angle would be off by up to 0.4 radians below
        position 2048."""
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def new_cache(self, batch_size: int, max_len: int | None = None) -> "KVCache":
        """An empty KV cache on the model's device, in its dtype."""
        p = self.tok_emb.weight
        max_len = max_len or self.config.max_seq_len
        return KVCache(self.config, batch_size, max_len, p.device, p.dtype)

    def forward(self, tokens, positions=None, attn_mask=None, cache=None,
                output_index=None, use_adapter=True, mask_slots=None):
        """Logits (B, T, V) for `tokens` (B, T); (B, N, V) at output_index (B, N).

        positions (B, T): RoPE positions, default 0..T-1.
        attn_mask: bool (T, T) or (B, T, T), True = may attend; default causal.
        cache: a KV cache (a KVCache, or anything with its attend and advance).
        Every layer attends through it, positions default to its next slots, and
        after the last layer it advances by T.
        use_adapter=False: the base model, whatever gated mask adapter it carries.
        mask_slots (B, T): with an adapter of one embedding per slot, each <mask>'s
        slot (default: 1 + the <mask>s just before it in its row).
        """
        T = tokens.shape[1]
        if cache is not None and attn_mask is not None:
            raise ValueError("attn_mask cannot be combined with a KV cache "
                             "(attention is causal by slot)")
        if positions is None and cache is not None:
            # row b's tokens go to slots lengths[b], lengths[b] + 1, ...
            positions = cache.lengths[:, None] + torch.arange(T, device=tokens.device)
        if positions is None:
            # (1, T): the same in every row
            positions = torch.arange(T, device=tokens.device)[None]
        mask = attn_mask
        if mask is not None and mask.dim() == 3:
            # the same for every head
            mask = mask[:, None]                                 # (B, 1, T, T)

        x, mask_rows = self.embed(tokens, use_adapter, mask_slots)  # (B, T, dim)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, mask_rows, cache)
        if cache is not None:
            # the T tokens are stored: the next pass writes after them
            cache.advance(T)
        return self.logits(x, output_index)

    def embed(self, tokens, use_adapter=True, mask_slots=None):
        """The embeddings (B, T, dim) of `tokens`, and mask_rows: with a gated mask
        adapter on, the rows of the flattened (B * T) tokens that hold <mask>."""
        x = self.tok_emb(tokens)
        if self.mask_embedding is None or not use_adapter:
            return x, None
        # The adapter's gate: its <mask> embedding and updates act only at the rows that
        # hold <mask>, so every other row is the base model's (nonzero waits for a GPU).
        is_mask = tokens == self.config.mask_token_id                     # (B, T)
        embedding = self.mask_embedding
        if embedding.dim() == 2:
            # one per slot: slot j is the j-th <mask> after the last ordinary token
            if mask_slots is None:
                mask_slots = slots_of(is_mask)
            embedding = embedding[(mask_slots - 1).clamp(0, len(embedding) - 1)]
        x = torch.where(is_mask[..., None], embedding.to(x.dtype), x)
        mask_rows = is_mask.flatten().nonzero().squeeze(1)
        return x, mask_rows

    def rope(self, positions, dtype):
        """cos and sin (B, 1, T, head_dim) of the RoPE angles at `positions` (B, T)."""
        angles = positions[..., None].float() * self.inv_freq        # (B, T, hd/2)
        # rotate_half: channels i and i + hd/2 turn by the same angle
        angles = torch.cat([angles, angles], dim=-1)[:, None]         # (B, 1, T, hd)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def logits(self, x, output_index=None):
        """lm_head(norm(x)) for x (B, T, dim); only at output_index (B, N) if given."""
        if output_index is not None:
            index = output_index[..., None].expand(-1, -1, x.shape[-1])
            x = x.gather(1, index)                                    # (B, N, dim)
        return self.lm_head(self.norm(x))

    def configure_optimizer(self, lr: float, weight_decay: float,
                            betas=(0.9, 0.95)) -> torch.optim.AdamW:
        """AdamW over the trainable parameters; no weight decay on the 1-D ones (the
        norms)."""
        params = [p for p in self.parameters() if p.requires_grad]
        matrices = [p for p in params if p.ndim >= 2]
        vectors = [p for p in params if p.ndim < 2]
        groups = [{"params": matrices, "weight_decay": weight_decay},
                  {"params": vectors, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def add_mask_token(model: Transformer, tokenizer, text: str = "<mask>", seed: int = 0) -> int:
    """Give model and tokenizer a `<mask>` token; return its id (the existing one, if
    any). Its rows are drawn with the used rows' per-dimension mean and std: a
    typical, uninformative token. The first spare row is used (Qwen3-4B: 151936 rows,
    151669 tokens), or the matrices grow."""
    cfg = model.config
    mask_id = tokenizer.special_tokens.get(text)
    if mask_id is not None and mask_id >= cfg.vocab_size:
        raise ValueError(f"tokenizer has {text} = {mask_id} but the model has only "
                         f"{cfg.vocab_size} rows")
    if mask_id is not None:
        cfg.mask_token_id = mask_id
        return mask_id

    n_used = mask_id = tokenizer.n_vocab
    # no spare row: append zero rows up to mask_id
    if mask_id >= cfg.vocab_size:
        def grown(w):
            extra = w.new_zeros(mask_id + 1 - w.shape[0], w.shape[1])
            return nn.Parameter(torch.cat([w.detach(), extra]), requires_grad=w.requires_grad)

        model.tok_emb.weight = grown(model.tok_emb.weight)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
        else:
            model.lm_head.weight = grown(model.lm_head.weight)
        cfg.vocab_size = mask_id + 1
        model.tok_emb.num_embeddings = model.lm_head.out_features = cfg.vocab_size

    g = torch.Generator().manual_seed(seed)
    matrices = [model.tok_emb.weight]
    if not cfg.tie_embeddings:
        matrices.append(model.lm_head.weight)
    for w in matrices:
        rows = w[:n_used].float()
        noise = torch.randn(w.shape[1], generator=g).to(w.device)
        w[mask_id] = (rows.mean(0) + rows.std(0) * noise).to(w.dtype)
    tokenizer.add_special_token(text, mask_id)
    cfg.mask_token_id = mask_id
    return mask_id


# ---- decoding: the KV cache ----------------------------------------------------------

class KVCache(nn.Module):
    """The keys and values of every token so far, (n_layers, B, n_kv_heads, max_len,
    head_dim), and how many slots each row holds, lengths (B,).

    A pass writes row b's T tokens at slots lengths[b] .. lengths[b] + T - 1 (also
    their positions), and each query attends to the slots up to its own: causal by
    slot. So a rollback erases nothing: the slots it frees are hidden from every
    query before them, and the next pass overwrites them."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int,
                 device=None, dtype=None):
        super().__init__()
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        for name in ("k", "v"):
            zeros = torch.zeros(shape, device=device, dtype=dtype)
            self.register_buffer(name, zeros, persistent=False)
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.register_buffer("lengths", lengths, persistent=False)
        self.max_len = max_len
        # at least every row's length, kept on the host: the overflow check reads the
        # device only when a pass might not fit
        self.longest = 0

    def attend(self, layer: int, q, k, v):
        """Store k, v (B, n_kv, T, hd) at each row's next T slots, then attend with
        q (B, n_heads, T, hd) over the slots up to each query's own."""
        T = q.shape[2]
        slots = self.lengths[:, None] + torch.arange(T, device=q.device)   # (B, T)
        # checked at the first layer, reading the device only near the end
        near_end = self.longest + T > self.max_len
        if layer == 0 and near_end and slots.max() >= self.max_len:
            raise ValueError(f"KV cache overflow: {int(slots.max()) + 1} slots needed, "
                             f"cache holds {self.max_len}")
        rows = torch.arange(len(slots), device=q.device)[:, None]          # (B, 1)
        # [rows, :, slots] is (B, T, n_kv, hd)
        self.k[layer][rows, :, slots] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, slots] = v.transpose(1, 2).to(self.v.dtype)
        seen = torch.arange(self.max_len, device=q.device) <= slots[..., None]  # (B, T, max_len)
        # in the pass's dtype: under FSDP2's mixed precision the cache is float32
        k = self.k[layer].to(q.dtype)
        v = self.v[layer].to(q.dtype)
        return attend(q, k, v, seen[:, None])

    def advance(self, T: int):
        """Transformer.forward's call after its layers: the pass's T tokens are stored."""
        self.lengths += T
        self.longest += T

    def rollback(self, lengths):
        """Forget every slot at or after `lengths` (an int, or one length per row)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        lengths = lengths.expand_as(self.lengths)
        # one read of the device
        if ((lengths > self.lengths) | (lengths < 0)).any():
            raise ValueError("rollback can only shorten the cache")
        self.lengths.copy_(lengths)
