"""A Llama-style transformer that can predict several tokens per forward pass.

Multi-token prediction (MTP) by self-distillation adds no heads: one new `<mask>`
token, and feeding `prefix <mask> <mask> ...` asks the unchanged network for the
next few tokens at once. The block is Llama's, x += Attention(RMSNorm(x)) and
x += SwiGLU(RMSNorm(x)), with RoPE, grouped-query attention (GQA), optional q/k
norms (Qwen3) and tied embeddings.

`Transformer.forward` is the training forward: explicit positions and any boolean
mask (the packed training layout). Decoding has a section of its own: the KV cache
is written at explicit slots, so decoding rolls mask slots back and overwrites
them, each row feeding its own number of tokens (`n_tokens`). mtp/hf.py reads and
writes Llama-3.x, Qwen3 and Qwen2 checkpoints in Hugging Face layout.

References: Llama 3 (arXiv 2407.21783), Qwen3 (2505.09388), RoFormer (2104.09864),
GQA (2305.13245), GLU variants (2002.05202), Multi-Token Prediction via
Self-Distillation (2602.06019).
"""

import functools
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
    mask None (causal) or bool (..., T, S). Masked kernels may lack GQA (torch falls
    back to float32 (B, H, T, S) scores), so the g query heads of a K/V head become
    g * T query rows of it."""
    B, H, T, hd = q.shape
    n_kv = k.shape[1]
    S = k.shape[2]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != n_kv)

    g = H // n_kv
    # query head h = kv * g + j becomes row j * T + t of K/V head kv
    q = q.reshape(B, n_kv, g * T, hd)
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], g, T, S)
    mask = mask.flatten(-3, -2)                                    # (..., g * T, S)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)    # (B, n_kv, g * T, hd)
    # reshape, not view: CUDA's memory-efficient kernel returns y transposed, laid
    # out as (B, g * T, n_kv, hd), and that layout cannot be split into
    # (B, H, T, hd) without a copy.
    return y.reshape(B, H, T, hd)


class Linear(nn.Linear):
    """nn.Linear that may carry a gated mask adapter, applied only at mask_rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a GatedLowRank (adapter.py), or None
        self.adapter = None

    def forward(self, x, mask_rows=None):
        """y = W x for x (..., d_in). With an adapter, its update is added in place at
        mask_rows, rows of x.flatten(0, -2) (y's backward does not need y itself)."""
        y = super().forward(x)
        a = self.adapter
        # no adapter, or a pass with no <mask>
        if a is None or mask_rows is None or len(mask_rows) == 0:
            return y
        x_mask = x.reshape(-1, x.shape[-1]).index_select(0, mask_rows)   # (n_mask, d_in)
        # In the adapter's dtype: float32 when loaded for decoding, as a CPU
        # multiplies a pass's few rows by the small matrices 5x faster in
        # float32 than in bfloat16 (training: what autocast or FSDP2 casts to).
        update = F.linear(F.linear(x_mask.to(a.down.dtype), a.down), a.up)   # (n_mask, d_out)
        y.view(-1, y.shape[-1]).index_add_(0, mask_rows, update.to(y.dtype), alpha=a.scale)
        return y


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
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

    def forward(self, x, cos, sin, mask=None, mask_rows=None, cached=None):
        """mask: None (causal) or bool, (T, T) or (B, 1, T, T). cached: an attention
        that also reads a KV cache and replaces `attend`: decoding's
        (CachedPass.attend) or the gated adapter's training pass (attend_after)."""
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

        if cached is None:
            y = attend(q, k, v, mask)
        else:
            y = cached(q, k, v)
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, mask=None, mask_rows=None, cached=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, mask_rows, cached)
        return x + self.mlp(self.mlp_norm(x), mask_rows)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
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
        p = self.tok_emb.weight
        max_len = max_len or self.config.max_seq_len
        return KVCache(self.config, batch_size, max_len, p.device, p.dtype)

    def forward(self, tokens, positions=None, attn_mask=None, cache=None,
                output_index=None, n_tokens=None, use_adapter=True, context=None):
        """Logits (B, T, V) for `tokens` (B, T); (B, N, V) at output_index (B, N).
        positions (B, T): RoPE positions, default 0..T-1. attn_mask: bool (T, T) or
        (B, T, T), True = may attend, default causal. With a KV `cache` (and
        n_tokens), decoding: see cached_forward. use_adapter=False: the base model,
        whatever gated mask adapter it carries. `context`: a KV cache whose first S
        slots the tokens read, but never write, before their own keys: attn_mask is
        then (B, T, S + T) (the gated adapter's training pass, attend_after)."""
        if cache is not None:
            # decoding takes its own path (the section below)
            return cached_forward(self, tokens, cache, positions=positions, attn_mask=attn_mask,
                                  output_index=output_index, n_tokens=n_tokens,
                                  use_adapter=use_adapter)
        if n_tokens is not None:
            raise ValueError("n_tokens needs a KV cache")
        if context is not None and attn_mask is None:
            raise ValueError("a pass after a context needs its attn_mask (B, T, S + T)")

        if positions is None:
            # (1, T): the same in every row
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        mask = attn_mask
        if mask is not None and mask.dim() == 3:
            # the same for every head
            mask = mask[:, None]                                 # (B, 1, T, T)
        x, mask_rows = self.embed(tokens, use_adapter)           # (B, T, dim)
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            attend_context = None
            if context is not None:
                attend_context = functools.partial(attend_after, context, i, mask)
            x = layer(x, cos, sin, mask, mask_rows, attend_context)
        return self.logits(x, output_index)

    def embed(self, tokens, use_adapter=True):
        """The embeddings (B, T, dim) of `tokens`, and mask_rows: with a gated mask
        adapter on, the rows of the flattened (B * T) tokens that hold <mask>."""
        x = self.tok_emb(tokens)
        if self.mask_embedding is None or not use_adapter:
            return x, None
        # The adapter's gate: its own <mask> embedding and its updates act only at
        # the rows that hold <mask>; every other row computes exactly what the base
        # model does.
        is_mask = tokens == self.config.mask_token_id                     # (B, T)
        x = torch.where(is_mask[..., None], self.mask_embedding.to(x.dtype), x)
        # On a GPU, nonzero waits for the device once a pass: the price of
        # computing the updates on the mask rows alone.
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


# ---- decoding: the KV cache and the cached, ragged pass ------------------------------
# A decoding pass feeds each row a few tokens (accepted ones, then <mask>s), each
# row its own number, and attends over the keys and values of every earlier pass,
# kept in the cache. Only attention mixes rows, so a ragged pass packs the real
# tokens of all rows into one row and computes nothing for the right-padding.


class KVCache(nn.Module):
    """Keys and values (n_layers, B, n_kv_heads, max_len, head_dim); a pass writes
    row b at slots lengths[b], ...; `rollback` erases nothing: attention is causal
    by slot, and later passes overwrite."""

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
        # a pass reads a multiple of this many slots (CachedPass)
        self.key_block = 64 if self.k.is_cuda else 1

    def rollback(self, lengths):
        """Forget everything at or after `lengths` (an int, or one length per row)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        lengths = lengths.expand_as(self.lengths)
        # one read of the device
        if ((lengths > self.lengths) | (lengths < 0)).any():
            raise ValueError("rollback can only shorten the cache")
        self.lengths.copy_(lengths)

    def keep_rows(self, rows):
        """Keep only these batch rows, in this order (finished sequences leave)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.k = self.k.index_select(1, idx)
        self.v = self.v.index_select(1, idx)
        self.lengths = self.lengths.index_select(0, idx)

    def write(self, layer: int, rows, slots, k, v):
        """Store k, v (N, n_kv_heads, head_dim) at (rows[i], slots[i]); return the
        layer's k, v (B, n_kv_heads, max_len, head_dim)."""
        self.k[layer][rows, :, slots] = k.to(self.k.dtype)
        self.v[layer][rows, :, slots] = v.to(self.v.dtype)
        return self.k[layer], self.v[layer]


def ragged_cells(lengths: list[int], fed: list[int], T: int):
    """Where each token of a cached pass goes. Row b of the (B, T) input feeds its
    first fed[b] tokens (the rest is right-padding); those N tokens are packed row
    after row. Attention spreads them over a (B', T) grid of the live rows (those
    that feed any). Returns the live rows and, for each packed token, its cache
    row, its cache slot (lengths[row] + t, also its RoPE position), its cell of
    the (B', T) grid and its cell of the (B, T) input, both flattened.

    Example: lengths [3, 5, 4], fed [2, 0, 1], T = 2. Row 1 feeds nothing, so the
    live rows are [0, 2] and N = 3:

        packed token       0  1  2
        cache row          0  0  2
        cache slot         3  4  4
        cell of (B', T)    0  1  2    (live row 1, row 2, starts at cell 2)
        cell of (B, T)     0  1  4    (row 2 starts at cell 4)

    ragged_cells([3, 5, 4], [2, 0, 1], 2)
        == ([0, 2], [0, 0, 2], [3, 4, 4], [0, 1, 2], [0, 1, 4])
    """
    live = [b for b, n in enumerate(fed) if n]
    # (live row, cache row, step) of each packed token
    cells = [(i, b, t) for i, b in enumerate(live) for t in range(fed[b])]
    rows = [b for _, b, _ in cells]
    slots = [lengths[b] + t for _, b, t in cells]
    grid = [i * T + t for i, _, t in cells]
    index = [b * T + t for _, b, t in cells]
    return live, rows, slots, grid, index


class CachedPass:
    """One cached pass of T tokens a row (ragged: n_tokens[b] of them). Its index
    tensors are built once, from the lengths read once from the device, so no
    layer waits for the device."""

    def __init__(self, cache: KVCache, T: int, n_tokens=None):
        self.cache = cache
        self.T = T
        self.ragged = n_tokens is not None
        device = cache.lengths.device
        # the pass's one read of the device
        lengths = cache.lengths.tolist()
        fed = [T] * len(lengths)
        if self.ragged:
            fed = n_tokens.tolist() if torch.is_tensor(n_tokens) else n_tokens
        new_lengths = [n + f for n, f in zip(lengths, fed)]
        S = max(new_lengths)
        if S > cache.max_len:
            raise ValueError(f"KV cache overflow: {S} slots needed, "
                             f"cache holds {cache.max_len}")
        # Read whole blocks of key slots (the mask hides the extra ones): a GPU
        # attention library that plans per shape (cuDNN) then plans once per block,
        # not once per pass as the keys grow.
        block = cache.key_block
        self.S = min(cache.max_len, -(-S // block) * block)

        tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        live, rows, slots, grid, index = ragged_cells(lengths, fed, T)
        self.rows = tensor(rows)
        self.slots = tensor(slots)
        self.grid = tensor(grid)
        self.index = tensor(index)
        # only the rows that feed tokens attend (all: a view, not a copy)
        self.live = slice(None)
        if len(live) < len(lengths):
            self.live = tensor(live)
        self.new_lengths = tensor(new_lengths)
        # causal by slot: grid cell (i, t) sees the slots up to its own position
        start = tensor([lengths[b] for b in live])
        positions = start[:, None] + torch.arange(T, device=device)       # (B', T)
        mask = torch.arange(self.S, device=device) <= positions[:, :, None]
        self.mask = mask[:, None]                                    # (B', 1, T, S)

    def pack(self, x):
        """(B, T) -> (1, N): a ragged pass's real tokens in one row."""
        if not self.ragged:
            return x
        return x.reshape(-1)[self.index][None]

    def spread(self, x, cells, n_rows: int):
        """Packed (N, ...) -> (n_rows, T, ...): x[i] at flat cell cells[i], zeros
        elsewhere."""
        shape = x.shape[1:]
        out = x.new_zeros(n_rows * self.T, *shape).index_copy_(0, cells, x)
        return out.view(n_rows, self.T, *shape)

    def attend(self, layer: int, q, k, v):
        """Write k, v (B, n_kv, T, hd) into the cache, then attend with q
        (B, n_heads, T, hd) over the cached slots -> (B, n_heads, T, hd). In a
        ragged pass B = 1 and T = N: the packed tokens."""
        k_new = k.transpose(1, 2).flatten(0, 1)                   # (N, n_kv, hd)
        v_new = v.transpose(1, 2).flatten(0, 1)
        k, v = self.cache.write(layer, self.rows, self.slots, k_new, v_new)
        # the first S slots of the live rows, in the pass's dtype (a cache built
        # from FSDP2's float32 shards holds float32; the pass computes in bfloat16)
        k = k[self.live, :, : self.S].to(q.dtype)                # (B', n_kv, S, hd)
        v = v[self.live, :, : self.S].to(q.dtype)
        if not self.ragged:
            return attend(q, k, v, self.mask)

        # spread the packed queries out to the (B', T) grid of their rows, and back
        q = self.spread(q[0].transpose(0, 1), self.grid, len(self.mask))
        y = attend(q.transpose(1, 2), k, v, self.mask)           # (B', n_heads, T, hd)
        y = y.transpose(1, 2).flatten(0, 1).index_select(0, self.grid)
        return y[None].transpose(1, 2)                            # (1, n_heads, N, hd)


def cached_forward(model: Transformer, tokens, cache: KVCache, positions=None,
                   attn_mask=None, output_index=None, n_tokens=None, use_adapter=True):
    """Transformer.forward with a KV cache: token t of row b goes to slot
    lengths[b] + t (its default position), and the lengths advance by T, or by
    n_tokens (B,), best a list: row b's real tokens (the right-padding is never
    computed, and its logits are meaningless)."""
    if attn_mask is not None:
        raise ValueError("attn_mask cannot be combined with a KV cache "
                         "(attention is causal by slot)")
    B, T = tokens.shape
    # 1) every index the pass needs
    p = CachedPass(cache, T, n_tokens)
    # 2) a ragged pass packs its real tokens into one row
    tokens = p.pack(tokens)                                  # (B, T) or (1, N)
    if positions is None:
        positions = p.slots.view(tokens.shape)
    else:
        positions = p.pack(positions)

    # 3) the layers, each writing its keys and values and attending over the cache
    x, mask_rows = model.embed(tokens, use_adapter)
    cos, sin = model.rope(positions, x.dtype)
    for i, layer in enumerate(model.layers):
        attend_cached = functools.partial(p.attend, i)
        x = layer(x, cos, sin, mask_rows=mask_rows, cached=attend_cached)
    # built with the plan: the host need not wait for the layers
    cache.lengths.copy_(p.new_lengths)

    # 4) a ragged pass unpacks: (B, T, dim), zeros at the padding
    if p.ragged:
        x = p.spread(x[0], p.index, B)
    return model.logits(x, output_index)


def attend_after(context: KVCache, layer: int, mask, q, k, v):
    """Attention for tokens that come after a context already in a KV cache: q, k, v
    (B, heads, T, hd) are the tokens' own; they attend over the cache's first S slots
    of this layer, then over each other, under mask (B, 1, T, S + T). The cache is
    read, not written, so gradients reach the tokens' keys and values.

    The gated adapter trains with it (adapter.gated_mtp_loss): its ground-truth rows
    are the base model's, computed once without gradient into the cache, and only
    the mask slots run with gradient, over them."""
    S = mask.shape[-1] - q.shape[2]
    k = torch.cat([context.k[layer, :, :, :S].to(k.dtype), k], dim=2)    # (B, n_kv, S + T, hd)
    v = torch.cat([context.v[layer, :, :, :S].to(v.dtype), v], dim=2)
    return attend(q, k, v, mask)
