"""A Llama-style transformer that can predict several tokens per forward pass.

Multi-token prediction (MTP) by self-distillation adds no heads: one new `<mask>` token, and
feeding `prefix <mask> <mask> ...` asks the unchanged network for the next few tokens at once.
The block is Llama's, x += Attention(RMSNorm(x)); x += SwiGLU(RMSNorm(x)), with RoPE, grouped-query
attention (GQA), optional q/k norms (Qwen3) and tied embeddings. `forward` takes explicit positions
and any boolean mask (the packed training layout); the KV cache is written at explicit slots, so
decoding rolls mask slots back and overwrites them, each row feeding its own number (`n_tokens`).
Below the plumbing line: Llama-3.x, Qwen3 and Qwen2 checkpoints in Hugging Face layout, in and out.
References: Llama 3 (arXiv 2407.21783), Qwen3 (2505.09388), RoFormer (2104.09864), GQA (2305.13245),
GLU variants (2002.05202), Multi-Token Prediction via Self-Distillation (2602.06019).
"""

import json
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclass
class ModelConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int | None = None        # None: dim // n_heads (Qwen3 sets it explicitly)
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    qk_norm: bool = False              # Qwen3: RMSNorm over each head of q and k before RoPE
    attn_bias: bool = False            # Qwen2: biases on the q/k/v projections
    tie_embeddings: bool = False       # the output matrix is the embedding matrix
    max_seq_len: int = 2048
    model_type: str = "llama"          # "llama" | "qwen3" | "qwen2" (names the HF architecture)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    mask_token_id: int | None = None   # set by add_mask_token

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.model_type not in HF_ARCHITECTURES:
            raise ValueError(f"unsupported model type {self.model_type!r}; supported: {', '.join(HF_ARCHITECTURES)}")

class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as Llama does)."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype, x = x.dtype, x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation frequency of each channel pair, (head_dim // 2,). Llama 3.1 scaling slows the
    wavelengths over original_max / low by `factor`, keeps those under original_max / high."""
    hd, scaling = cfg.head_dim, cfg.rope_scaling
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if not scaling:
        return inv_freq.float()
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_max = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    s = ((original_max / wavelen) - low) / (high - low)                  # 0 at long, 1 at short end
    smoothed = (1 - s) * inv_freq / factor + s * inv_freq
    scaled = torch.where(wavelen > original_max / low, inv_freq / factor, smoothed)
    return torch.where(wavelen < original_max / high, inv_freq, scaled).float()

def apply_rope(x, cos, sin):
    """Rotate channel i with channel i + head_dim/2 (the 'rotate_half' layout of HF checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin

class KVCache(nn.Module):
    """Keys and values (n_layers, B, n_kv_heads, max_len, head_dim); a pass writes row b at slots
    lengths[b], ...; `rollback` erases nothing: attention is causal by slot, passes overwrite."""
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None, dtype=None):
        super().__init__()
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.max_len = max_len
        self.key_block = 64 if self.k.is_cuda else 1    # a pass reads a multiple of this many slots

    def rollback(self, lengths):
        """Forget everything at or after `lengths` (an int, or one length per row)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).expand_as(self.lengths)
        if ((lengths > self.lengths) | (lengths < 0)).any():                # one read of the device
            raise ValueError("rollback can only shorten the cache")
        self.lengths.copy_(lengths)

    def keep_rows(self, rows):
        """Keep only these batch rows, in this order (finished sequences leave a batch)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.k, self.v = self.k.index_select(1, idx), self.v.index_select(1, idx)
        self.lengths = self.lengths.index_select(0, idx)

    def write(self, layer: int, rows, slots, k, v):
        """Store k, v (N, n_kv_heads, head_dim) at (rows[i], slots[i]); return the layer's k, v."""
        self.k[layer][rows, :, slots] = k.to(self.k.dtype)         # cache layer is (B, n_kv, S, hd)
        self.v[layer][rows, :, slots] = v.to(self.v.dtype)
        return self.k[layer], self.v[layer]

@dataclass
class CachedPass:
    """Index tensors of a cached pass of N tokens, built once from host-side lengths: no layer waits
    for the device to read a length. B' rows feed tokens; ragged: rows feed different numbers."""
    rows: torch.Tensor                  # (N,) cache row of each fed token, row after row
    slots: torch.Tensor                 # (N,) its cache slot
    mask: torch.Tensor                  # (B', T, S) bool: token t sees slot s (causal by slot)
    positions: torch.Tensor             # (B', T) RoPE position of each grid cell (its slot)
    S: int                              # key slots read: the longest row after it, rounded up
    new_lengths: torch.Tensor           # (B,) each row's length after this pass
    live: torch.Tensor | None = None    # ragged: (B',) the rows that feed tokens; None when all do
    grid: torch.Tensor | None = None    # ragged: (N,) each token's cell in the (B', T) grid
    index: torch.Tensor | None = None   # ragged: (N,) the same in the caller's (B, T) grid

def plan_cached_pass(cache: KVCache, T: int, n_tokens=None) -> CachedPass:
    device, lengths = cache.lengths.device, cache.lengths.tolist()    # the pass's one device read
    fed = [T] * len(lengths) if n_tokens is None else n_tokens.tolist() if torch.is_tensor(n_tokens) else list(n_tokens)
    S = max(n + f for n, f in zip(lengths, fed))
    if S > cache.max_len:
        raise ValueError(f"KV cache overflow: {S} slots needed, cache holds {cache.max_len}")
    # Read whole blocks of key slots (the mask hides the extra ones): a GPU attention library that
    # plans per shape (cuDNN) then plans once per block, not once per pass as the keys grow.
    S = min(cache.max_len, -(-S // cache.key_block) * cache.key_block)
    live = [b for b, f in enumerate(fed) if f] if n_tokens is not None else list(range(len(fed)))
    cells = [(i, b, t) for i, b in enumerate(live) for t in range(fed[b])]  # (grid row, cache row, step)
    tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    positions = tensor([lengths[b] for b in live])[:, None] + torch.arange(T, device=device)  # (B', T)
    mask = torch.arange(S, device=device)[None, None, :] <= positions[:, :, None]       # (B', T, S)
    ragged = n_tokens is not None
    return CachedPass(tensor([b for _, b, _ in cells]), tensor([lengths[b] + t for _, b, t in cells]),
                      mask, positions, S, tensor([n + f for n, f in zip(lengths, fed)]),
                      tensor(live) if ragged and len(live) < len(fed) else None,
                      tensor([i * T + t for i, _, t in cells]) if ragged else None,       # grid
                      tensor([b * T + t for _, b, t in cells]) if ragged else None)       # index

def to_grid(x, p: CachedPass, n_rows: int):
    """Packed (N, ...) -> (n_rows, T, ...) with zeros at the padding; n_rows is B' or B."""
    T = p.mask.shape[1]
    out = x.new_zeros(n_rows * T, *x.shape[1:]).index_copy_(0, p.grid if n_rows == len(p.mask) else p.index, x)
    return out.view(n_rows, T, *x.shape[1:])

def attend(q, k, v, mask):
    """softmax(q k^T / sqrt(hd) + mask) v; q (B, H, T, hd), k, v (B, n_kv, S, hd), mask None
    (causal) or bool (..., T, S). Masked kernels may lack GQA (torch falls back to float32
    (B, H, T, S) scores), so the g query heads of a K/V head become g * T query rows of it."""
    B, H, T, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != n_kv)
    g = H // n_kv
    q = q.reshape(B, n_kv, g * T, hd)                   # query head h = kv * g + j -> row j * T + t
    mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], g, T, S).flatten(-3, -2)    # (..., g * T, S)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)          # (B, n_kv, g * T, hd)
    # reshape, not view: CUDA's memory-efficient kernel returns y transposed, laid out as
    # (B, g * T, n_kv, hd), and that layout cannot be split into (B, H, T, hd) without a copy.
    return y.reshape(B, H, T, hd)

class GatedLowRank(nn.Module):
    """The gated mask adapter's update to one projection: scale * up(down(x)), computed and added
    only at the rows whose input token is <mask>. `up` starts at zero, so a new adapter changes
    nothing. Not a LoRA to merge into the weight: applied at every row it would change them all."""
    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float, generator=None):
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, d_in, generator=generator) / math.sqrt(d_in))
        self.up = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = alpha / rank

    def forward(self, x, y, mask_rows):
        """y = W x for x (..., d_in); add the update at mask_rows of x.flatten(0, -2), in place
        (y's backward does not need y itself)."""
        x_mask = x.reshape(-1, x.shape[-1]).index_select(0, mask_rows)            # (n_mask, d_in)
        update = (x_mask @ self.down.T.to(x.dtype)) @ self.up.T.to(x.dtype) * self.scale
        y.view(-1, y.shape[-1]).index_add_(0, mask_rows, update.to(y.dtype))
        return y

class Linear(nn.Linear):
    """nn.Linear that may carry a gated mask adapter, applied only at the rows in mask_rows."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter: GatedLowRank | None = None

    def forward(self, x, mask_rows=None):
        y = super().forward(x)
        if self.adapter is None or mask_rows is None or len(mask_rows) == 0:   # a pass with no <mask>
            return y
        return self.adapter(x, y, mask_rows)

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask, cache=None, layer=0, plan: CachedPass | None = None, mask_rows=None):
        B, T, _ = x.shape                                            # ragged: (1, N) real tokens
        q = self.wq(x, mask_rows).view(B, T, self.n_heads, self.head_dim)       # (B, T, n_heads, hd)
        k = self.wk(x, mask_rows).view(B, T, self.n_kv_heads, self.head_dim)    # (B, T, n_kv_heads, hd)
        v = self.wv(x, mask_rows).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:                               # Qwen3: per-head norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, heads, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            new = (t.transpose(1, 2).reshape(-1, self.n_kv_heads, self.head_dim) for t in (k, v))
            k, v = cache.write(layer, plan.rows, plan.slots, *new)       # (N, n_kv, hd) each, in
            k, v = k[:, :, : plan.S], v[:, :, : plan.S]                           # (B, n_kv, S, hd)
            if plan.live is not None:                        # only the rows that feed tokens attend
                k, v = k.index_select(0, plan.live), v.index_select(0, plan.live)  # (B', n_kv, S, hd)
        ragged = plan is not None and plan.grid is not None
        if ragged:                 # spread the packed queries out to the (B', T) grid of their rows
            q = to_grid(q[0].transpose(0, 1), plan, len(plan.mask)).transpose(1, 2)  # (B', n_heads, T, hd)
        y = attend(q, k, v, mask).transpose(1, 2)                    # (B, T, n_heads, hd)
        if ragged:
            y = y.reshape(-1, self.n_heads, self.head_dim).index_select(0, plan.grid)[None]  # (1, N, n_heads, hd)
        return self.wo(y.reshape(B, T, self.n_heads * self.head_dim), mask_rows)

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
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim, cfg.norm_eps), SwiGLU(cfg)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, plan=None, mask_rows=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, plan, mask_rows)
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
        self.mask_embedding = None            # the gated mask adapter's <mask> input (add_mask_adapter)
        self.adapter_on = True                # False: the base model, whatever adapter it carries
        for module in self.modules():                                # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def _apply(self, fn, *args, **kwargs):
        """.to(), .cuda(), .bfloat16() ... move the RoPE frequencies but never round them: in
        bfloat16 a position's angle would be off by up to 0.4 radians below position 2048."""
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        p = self.tok_emb.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_seq_len, p.device, p.dtype)

    def forward(self, tokens, positions=None, attn_mask=None, cache=None, output_index=None, n_tokens=None):
        """Logits for `tokens` (B, T). positions (B, T): RoPE positions, default 0..T-1 or
        continuing the cache. attn_mask: bool (T, T) or (B, T, T), True = may attend, default
        causal; not with a cache, where token t of row b goes to slot lengths[b] + t and lengths
        advance by T (or by n_tokens: (B,), best a list, row b's real tokens; the right-padding is
        never computed). output_index (B, N): positions whose logits are wanted -> (B, N, V)."""
        (B, T), device = tokens.shape, tokens.device
        if cache is not None and attn_mask is not None:
            raise ValueError("attn_mask cannot be combined with a KV cache (attention is causal by slot)")
        if cache is None and n_tokens is not None:
            raise ValueError("n_tokens needs a KV cache")
        plan = None if cache is None else plan_cached_pass(cache, T, n_tokens)   # every index it needs
        mask = plan.mask if plan is not None else attn_mask       # None: causal; cached: (B', T, S)
        mask = mask[:, None] if mask is not None and mask.dim() == 3 else mask   # same for all heads
        ragged = plan is not None and plan.grid is not None
        if ragged:
            # Only attention mixes tokens: pack the real ones into one row of N = sum(n_tokens).
            tokens = tokens.reshape(-1)[plan.index][None]                                 # (1, N)
            positions = plan.slots[None] if positions is None else positions.reshape(-1)[plan.index][None]
        elif positions is None:                                                           # (B, T)
            positions = plan.positions if plan is not None else torch.arange(T, device=device)[None].expand(B, T)
        x = self.tok_emb(tokens)                                        # (B, T, dim) or (1, N, dim)
        mask_rows = None
        if self.mask_embedding is not None and self.adapter_on:
            # The gate of the mask adapter: its own <mask> embedding and its updates act only at
            # the rows that hold <mask>; every other row computes exactly what the base model does.
            is_mask = tokens == self.config.mask_token_id                         # (B, T)
            x = torch.where(is_mask[..., None], self.mask_embedding.to(x.dtype), x)
            # Rows of the flattened (B*T, dim). On a GPU, nonzero waits for the device once a pass:
            # the price of computing the updates on the mask rows alone.
            mask_rows = is_mask.flatten().nonzero().squeeze(1)
        angles = positions[..., None].float() * self.inv_freq                # (B, T, hd/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None]           # (B, 1, T, hd): rotate_half
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, plan, mask_rows)
        if cache is not None:       # built with the plan: the host need not wait for the layers
            cache.lengths.copy_(plan.new_lengths)
        if ragged:
            x = to_grid(x[0], plan, B)                                   # (B, T, dim), zeros at padding
        if output_index is not None:
            x = x.gather(1, output_index[..., None].expand(-1, -1, x.shape[-1]))   # (B, N, dim)
        return self.lm_head(self.norm(x))

    def configure_optimizer(self, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
        """AdamW over the trainable parameters; no weight decay on the 1-D ones (the norms)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32) -> "Transformer":
        return load_hf(cls, path, device, dtype)
    def save_pretrained(self, path, max_shard_bytes: int = 5 * 2**30, dtype=None):
        save_hf(self, path, max_shard_bytes, dtype)

@torch.no_grad()
def add_mask_token(model: Transformer, tokenizer, text: str = "<mask>", seed: int = 0) -> int:
    """Give model and tokenizer a `<mask>` token; return its id (the existing one, if any). Its
    rows are drawn with the used rows' per-dimension mean and std: a typical, uninformative token.
    The first spare row is used (Qwen3-4B: 151936 rows, 151669 tokens), or the matrices grow."""
    cfg = model.config
    mask_id = tokenizer.special_tokens.get(text)
    if mask_id is not None and mask_id >= cfg.vocab_size:
        raise ValueError(f"tokenizer has {text} = {mask_id} but the model has only {cfg.vocab_size} rows")
    if mask_id is None:
        n_used = mask_id = tokenizer.n_vocab
        if mask_id >= cfg.vocab_size:                     # no spare row: append zero rows up to mask_id
            def grown(w):
                extra = w.new_zeros(mask_id + 1 - w.shape[0], w.shape[1])
                return nn.Parameter(torch.cat([w.detach(), extra]), requires_grad=w.requires_grad)
            model.tok_emb.weight = grown(model.tok_emb.weight)
            model.lm_head.weight = model.tok_emb.weight if cfg.tie_embeddings else grown(model.lm_head.weight)
            model.tok_emb.num_embeddings = model.lm_head.out_features = cfg.vocab_size = mask_id + 1
        g = torch.Generator().manual_seed(seed)
        for w in [model.tok_emb.weight] + ([] if cfg.tie_embeddings else [model.lm_head.weight]):
            rows = w[:n_used].float()
            noise = torch.randn(w.shape[1], generator=g).to(w.device)
            w[mask_id] = (rows.mean(0) + rows.std(0) * noise).to(w.dtype)
        tokenizer.add_special_token(text, mask_id)
    cfg.mask_token_id = mask_id
    return mask_id

# ---- the gated mask adapter ------------------------------------------------------------------
# An alternative to tuning every weight: freeze the model, and train only a low-rank update to
# chosen projections plus a <mask> embedding of its own, both acting only at the rows whose input
# token is <mask>. Ordinary tokens never attend to mask slots (in training and in decoding), so at
# every ordinary position the hidden states, cache entries and logits stay exactly the base
# model's: greedy decoding and the lossless mode print the untuned model's text, and the
# distillation teacher is the student itself with the adapter off (no second copy). Saved as a
# small folder beside the unchanged base model; not a plain LoRA (applied everywhere, it would
# change every position), so the files have names of their own.
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "mask_adapter.json", "mask_adapter.safetensors"
ADAPTER_TYPE = "gated-mask-lora"
ADAPTER_TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")

def add_mask_adapter(model: Transformer, rank: int, alpha: float, targets=ADAPTER_TARGETS, seed: int = 0):
    """Freeze `model` (which has <mask>) and give it a fresh gated mask adapter: a GatedLowRank on
    each Linear named in targets (seeded), and a trainable <mask> embedding starting at the current one."""
    if model.config.mask_token_id is None:
        raise ValueError("the gated mask adapter needs a model with a <mask> token (add_mask_token)")
    unknown = sorted(set(targets) - set(ADAPTER_TARGETS))
    if unknown:
        raise ValueError(f"unknown adapter targets {unknown}; choose from {', '.join(ADAPTER_TARGETS)}")
    model.requires_grad_(False)
    device, generator = model.tok_emb.weight.device, torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in targets:
            with torch.device("cpu"):                         # the generator's device
                adapter = GatedLowRank(module.in_features, module.out_features, rank, alpha, generator)
            module.adapter = adapter.to(device)
    row = model.tok_emb.weight[model.config.mask_token_id].detach()
    model.mask_embedding = nn.Parameter(row.float().clone())
    model.adapter_config = {"rank": rank, "alpha": alpha, "targets": list(targets)}

def is_adapter_tensor(name: str) -> bool:
    return ".adapter." in name or name == "mask_embedding"

def adapter_state(model: Transformer) -> dict:
    """The adapter's tensors by name: what a gated mask adapter saves and trains."""
    return {name: t for name, t in model.state_dict().items() if is_adapter_tensor(name)}

def save_mask_adapter(model: Transformer, path, base_model, dtype=torch.float32):
    """Write the adapter (in `dtype`) and its config into folder `path`, naming the base folder."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {n: t.detach().to(dtype).contiguous().cpu() for n, t in adapter_state(model).items()}
    atomic_save(lambda p: save_file(tensors, p, metadata={"format": "pt"}), os.path.join(path, ADAPTER_WEIGHTS))
    config = {"adapter_type": ADAPTER_TYPE,
              "applies_at": "input positions holding mask_token_id only; every other position is the base model",
              "base_model": os.path.relpath(base_model, path), **model.adapter_config,
              "mask_token_id": model.config.mask_token_id}
    write_json(os.path.join(path, ADAPTER_CONFIG), config)

def is_adapter_folder(path) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))

def read_adapter_config(path) -> dict:
    """The adapter's config, with base_model resolved to a path (it is stored relative to `path`)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    config = read_json(file, "mask adapter config")
    missing = [k for k in ("adapter_type", "base_model", "rank", "alpha", "targets", "mask_token_id") if k not in config]
    if missing or config["adapter_type"] != ADAPTER_TYPE:
        problem = f"missing {', '.join(missing)}" if missing else f"adapter_type is not {ADAPTER_TYPE!r}"
        raise ValueError(f"{file}: {problem}")
    config["base_model"] = os.path.normpath(os.path.join(path, config["base_model"]))
    return config

def load_mask_adapter(model: Transformer, path):
    """Attach the adapter saved in folder `path` to its base model (with <mask> added), in the
    model's dtype: for decoding (training keeps a fresh adapter in float32)."""
    from safetensors.torch import load_file
    config = read_adapter_config(path)
    if model.config.mask_token_id != config["mask_token_id"]:
        raise ValueError(f"{path}: the adapter's <mask> is token {config['mask_token_id']}, "
                         f"the model's is {model.config.mask_token_id}")
    add_mask_adapter(model, config["rank"], config["alpha"], config["targets"])
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in {path}")
    tensors, expected = load_file(file), adapter_state(model)
    wrong = sorted(set(tensors) ^ set(expected))
    wrong += [n for n in expected if n in tensors and tensors[n].shape != expected[n].shape]
    if wrong:
        raise ValueError(f"{file} does not match its config: {', '.join(wrong[:3])}")
    model.load_state_dict(tensors, strict=False)
    dtype = model.tok_emb.weight.dtype
    for p in model.parameters():
        if p.requires_grad:                                       # the adapter's, float32 so far
            p.data = p.data.to(dtype)
    return model.requires_grad_(False)

# ---- plumbing: Hugging Face checkpoints, files -----------------------------------------------
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
HF_NAMES = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head",
            "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
            **{f"attn.w{x}": f"self_attn.{x}_proj" for x in "qkvo"},  # attn.wq: self_attn.q_proj
            **{f"attn.{x}_norm": f"self_attn.{x}_norm" for x in "qk"},   # q/k norms: Qwen3
            **{f"mlp.{x}": f"mlp.{x}_proj" for x in ("gate", "up", "down")}}

def hf_names(model: Transformer) -> dict:
    """{Hugging Face name: our name} of each tensor in a checkpoint (a tied lm_head is not)."""
    names = {}
    for name in model.state_dict():
        if is_adapter_tensor(name):                   # a gated mask adapter saves on its own
            continue
        layer, module, suffix = re.fullmatch(r"(layers\.\d+\.)?(.+)\.(weight|bias)", name).groups()
        if not (name == "lm_head.weight" and model.config.tie_embeddings):
            names[f"{'model.' + layer if layer else ''}{HF_NAMES[module]}.{suffix}"] = name
    return names

def load_hf(cls, path, device, dtype) -> Transformer:
    """Transformer.from_pretrained; names and shapes are checked first: a bad file fails loudly."""
    cfg, tensors = read_model_config(path), read_safetensors(path)
    with torch.device("meta"):
        model = cls(cfg)
    names, shapes = hf_names(model), {n: list(t.shape) for n, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)                # some exports write the tied copy anyway
    wrong = [f"{h} {list(tensors[h].shape)} (expected {shapes[names[h]]})"
             for h in sorted(set(names) & set(tensors)) if list(tensors[h].shape) != shapes[names[h]]]
    missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    problems = [f"{what} {', '.join(bad[:3])}" + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
                for what, bad in (("missing", missing), ("unexpected", unexpected)) if bad]
    problems += [f"wrong shape {', '.join(wrong[:3])}"] if wrong else []      # three named at most
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: " + "; ".join(problems))
    ours = {names[h]: tensors.pop(h).to(device=device, dtype=dtype) for h in list(tensors)}  # one at a time
    model.load_state_dict(ours, assign=True, strict=not cfg.tie_embeddings)   # tied: lm_head next
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()

def save_hf(model: Transformer, path, max_shard_bytes: int, dtype=None):
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    sd = model.state_dict()
    state = {h: sd[n].detach().to(dtype or sd[n].dtype).contiguous().cpu() for h, n in hf_names(model).items()}
    shards, size = [{}], 0
    for name, t in state.items():
        if shards[-1] and size + t.numel() * t.element_size() > max_shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    for stale in os.listdir(path):               # leftovers of an earlier, differently sharded save
        if stale.startswith("model") and stale.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, stale))
    n = len(shards)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else ["model.safetensors"]
    for file, shard in zip(files, shards):
        atomic_save(lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}), os.path.join(path, file))
    if n > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
        write_json(os.path.join(path, "model.safetensors.index.json"), index)
    write_json(os.path.join(path, "config.json"), config_to_hf(model.config, next(iter(state.values())).dtype))

def config_from_hf(hf: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                         f"supported: {', '.join(HF_ARCHITECTURES)}")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=true")
    # New transformers: rope_parameters {rope_theta, rope_type, ...}; old: rope_theta, rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope = rope or dict(hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}} if rope_type == "llama3" else None
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        rope_scaling=scaling, qk_norm=model_type == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attn_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)), model_type=model_type,
        max_seq_len=hf.get("max_position_embeddings", 2048), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), mask_token_id=hf.get("mask_token_id"))

def config_to_hf(cfg: ModelConfig, dtype=torch.float32) -> dict:
    """The config.json of `cfg`, in the old style that old and new transformers (and vLLM) read."""
    return {"architectures": [HF_ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
            **({} if cfg.model_type == "qwen2" else {"attention_bias": cfg.attn_bias}),  # Qwen2: on
            "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "mask_token_id": cfg.mask_token_id, "torch_dtype": str(dtype).removeprefix("torch.")}

def read_json(path, what="file") -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, found a {type(obj).__name__}")
    return obj

def read_model_config(path) -> ModelConfig:
    file = os.path.join(path, "config.json")
    hf = read_json(file, "model config")
    try:
        return config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        problem = f"missing field {e}" if isinstance(e, KeyError) else str(e).replace(" in config.json", "")
        raise ValueError(f"{file}: {problem}") from None

def write_json(path, obj):
    atomic_save(lambda p: open(p, "w").write(json.dumps(obj, indent=2) + "\n"), path)

def atomic_save(write, path):
    """Call write(tmp_path), then rename over `path`: a crash never leaves a half-written file.
    The file gets the mode open() gives (safetensors writes its files for the owner only)."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)

def read_safetensors(path) -> dict:
    """All tensors of a single-file or sharded safetensors checkpoint (never unpickles)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    single, index = (os.path.join(path, f) for f in ("model.safetensors", "model.safetensors.index.json"))
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    tensors = {}
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"missing checkpoint shard {f}")
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"cannot read {f} (truncated or corrupt safetensors file): {e}") from None
    return tensors
