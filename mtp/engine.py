"""The decoding engine: confadapt.py's rules with a KV cache, ragged passes and continuous
batching. Every command decodes with it (confadapt.py, the eval commands, train_toy.py's
evaluation, the benchmarks), so every speed figure is its speed. A learner can skip this file:
confadapt.py's `generate` is the same decoding, plainly written, and the tests hold both to
`confadapt.generate_uncached`, the definition.

What it adds for throughput:

- Ragged passes. A decoding pass feeds each row a few tokens (the accepted ones, then drafts and
  <mask>s), each row its own number. Only attention mixes rows, so a pass packs the real tokens
  of all rows into one row and never computes the right-padding: `RaggedPass` is the `cache` of
  `Transformer.forward` that writes each packed token at its row's slot and spreads the queries
  back onto their rows for attention. A row that feeds far more than the others (a prompt
  joining a server's batch) attends in a group of its own (`attention_groups`), so the others'
  queries are not spread over its length.
- Continuous batching. A finished row's cache row goes to the next waiting prompt, and with none
  left the batch shrinks (`DecodeCache.keep_rows`).
- Few waits for the device. The cache keeps its lengths on the host as well, so a pass builds
  every index, and its attention masks, from host lists, sends them to the device in one copy,
  and sets the new lengths without waiting for the layers. Each mask is made once a pass, in the
  pass's dtype, for every layer. A decoding pass waits for the device at most 4 times (the
  copy, the predictions and, ConfAdapt alone, their confidences, the rollback's lengths), 5
  with the gated adapter (the rows that hold <mask>).
- Whole blocks of key slots on a GPU (`DecodeCache.key_block`), so an attention library that
  plans per shape (cuDNN) plans once per block, not once per pass.

A row's output is the one it gets alone, up to float rounding.
"""

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adapter import check_slots
from confadapt import DecodeConfig, accept, drafts_and_masks, top1
from mtp.calibration import slot_temperatures
from model import KVCache, Transformer, attend, kernel_mask

aten = torch.ops.aten


# ---- the cache and one ragged pass ------------------------------------------------------------

class DecodeCache(KVCache):
    """model.KVCache, plus what continuous batching needs: rows leave it (keep_rows) and join it
    (grow), and a pass reads whole blocks of key_block slots (RaggedPass).

    k and v are views of the first B rows of a storage that keeps room for the most rows the
    cache has held: rows that leave cost a copy of only the rows that change place (serve.py
    moves the last rows into the gaps), and a row that joins takes a place already there.
    Copying the whole cache instead, twice for every request that finishes and the next that
    joins, cost more than a pass at 32 rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_block = 64 if self.k.is_cuda else 1
        # each row's length, on the host too: a pass plans from it without reading the device
        self.host_lengths = [0] * len(self.lengths)
        self.storage = {"k": self.k, "v": self.v}

    def keep_rows(self, rows):
        """Keep only these batch rows, in this order (finished sequences leave)."""
        moved = [(i, r) for i, r in enumerate(rows) if i != r]
        if moved:
            to, source = (torch.as_tensor(x, dtype=torch.long, device=self.lengths.device)
                          for x in zip(*moved))
            for t in self.storage.values():
                # the moving rows are read before any is written
                t.index_copy_(1, to, t.index_select(1, source))
        self.k, self.v = (t[:, :len(rows)] for t in self.storage.values())
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.lengths = self.lengths.index_select(0, idx)
        self.host_lengths = [self.host_lengths[r] for r in rows]

    def advance(self, T: int):
        """A pass of model.KVCache's own (Transformer.forward with this cache)."""
        super().advance(T)
        self.host_lengths = [n + T for n in self.host_lengths]

    def rollback(self, lengths):
        """KVCache.rollback, checked on the host: `lengths` an int or a list (a tensor is read
        from the device)."""
        if torch.is_tensor(lengths):
            lengths = lengths.tolist()
        if isinstance(lengths, int):
            lengths = [lengths] * len(self.host_lengths)
        if any(n > old or n < 0 for n, old in zip(lengths, self.host_lengths)):
            raise ValueError("rollback can only shorten the cache")
        self.lengths.copy_(torch.tensor(lengths, dtype=torch.long, device=self.lengths.device))
        self.host_lengths = list(lengths)
        self.longest = max(lengths, default=0)

    def grow(self, batch_size: int, max_len: int):
        """Room for batch_size rows of max_len slots (never less than now): the new rows are
        empty, the old keep their keys. A server's batch grows as requests arrive."""
        batch_size = max(batch_size, len(self.lengths))
        max_len = max(max_len, self.max_len)
        old = len(self.lengths)
        if batch_size > self.storage["k"].shape[1] or max_len > self.max_len:
            for name, t in self.storage.items():
                # (n_layers, B, n_kv_heads, max_len, head_dim)
                new = t.new_zeros(t.shape[0], batch_size, t.shape[2], max_len, t.shape[4])
                new[:, :old, :, : self.max_len] = t[:, :old]
                self.storage[name] = new
        # rows taken from storage hold a finished row's keys: length 0 hides them
        self.k, self.v = (t[:, :batch_size] for t in self.storage.values())
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(batch_size - old)])
        self.host_lengths = self.host_lengths + [0] * (batch_size - old)
        self.max_len = max_len


def new_cache(model: Transformer, batch_size: int, max_len: int) -> DecodeCache:
    p = model.tok_emb.weight
    return DecodeCache(model.config, batch_size, max_len, p.device, p.dtype)


def ragged_cells(lengths: list[int], fed: list[int], T: int):
    """Where each token of a ragged pass goes. Row b of the (B, T) input feeds its
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


class RaggedPass:
    """One cached pass of T tokens a row, of which row b feeds its first fed[b] (all T if fed is
    None), as the `cache` Transformer.forward attends through. A ragged pass (some row feeds
    fewer than T) runs on its N real tokens packed into one row: `upload` the indices, `pack`
    the tokens, give `positions`, and read the logits at `packed_places`.

    Its index tensors and mask are built once, from the lengths the cache keeps on the host,
    and reach the device in one copy (`upload`), so no layer waits for the device."""

    def __init__(self, cache: DecodeCache, T: int, fed=None):
        self.cache = cache
        self.T = T
        lengths = cache.host_lengths
        if fed is None:
            fed = [T] * len(lengths)
        if torch.is_tensor(fed):
            fed = fed.tolist()
        self.fed = fed
        self.ragged = any(f != T for f in fed)
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
        self.new_lengths = new_lengths
        self.cells = ragged_cells(lengths, fed, T)
        # where row b's packed tokens start
        self.starts = list(itertools.accumulate(fed, initial=0))
        # the rows attend in one group, or a ragged pass's in two (attention_groups): each
        # group's (rows, T, S)
        if not self.ragged:
            self.groups = [(list(range(len(fed))), T, self.S)]
        else:
            self.groups = []
            for rows in attention_groups(fed):
                longest = max(new_lengths[b] for b in rows)
                S_g = min(cache.max_len, -(-longest // block) * block)
                self.groups.append((rows, max(fed[b] for b in rows), S_g))

    def upload(self, *more):
        """The pass's indices on the device, with `more` lists of ints, in one copy (each
        torch.tensor(list) is a copy the device's queue waits for) -> `more` as tensors."""
        _, rows, slots, _, index = self.cells
        host = self.cache.host_lengths
        # each group: its rows, its packed tokens, their cells of its (rows, T_g) grid and
        # the rows' first slots (causal by slot: cell (i, t) sees the slots up to its own)
        groups = []
        for g, T_g, _ in self.groups:
            # (group row i, cache row b, step t) of each token; a pass that is not ragged
            # attends in place, with no tokens to move
            cells = ([(i, b, t) for i, b in enumerate(g) for t in range(self.fed[b])]
                     if self.ragged else [])
            groups += [g, [self.starts[b] + t for _, b, t in cells],
                       [i * T_g + t for i, _, t in cells], [host[b] for b in g]]
        lists = [rows, slots, index, self.new_lengths, *groups, *more]
        flat = torch.tensor(list(itertools.chain(*lists)), dtype=torch.long,
                            device=self.cache.lengths.device)
        tensors = flat.split([len(x) for x in lists])
        self.rows, self.slots, self.index, self.lengths = tensors[:4]
        # each token's RoPE position is its slot: (1, N) packed, else (B, T)
        self.positions = self.slots.view(1, -1) if self.ragged else self.slots.view(-1, self.T)
        self.attention = []
        for i, (g, T_g, S_g) in enumerate(self.groups):
            live, tokens, grid, starts = tensors[4 + 4 * i: 8 + 4 * i]
            positions = starts[:, None] + torch.arange(T_g, device=flat.device)   # (B', T_g)
            mask = torch.arange(S_g, device=flat.device) <= positions[:, :, None]
            # only the rows that feed tokens attend (all: a view, not a copy)
            live = slice(None) if len(g) == len(self.fed) else live
            # [rows, packed tokens, grid cells, T, S, (B', 1, T, S) mask, the mask as the
            # kernel takes it: made by the first layer, in its dtype (kernel_mask)]
            self.attention.append([live, tokens, grid, T_g, S_g, mask[:, None], None])
        return tensors[4 + 4 * len(self.groups):]

    def pack(self, x):
        """(B, T) -> (1, N): a ragged pass's real tokens in one row."""
        if not self.ragged:
            return x
        return x.reshape(-1)[self.index][None]

    def packed_places(self, places: list[list[int]]) -> list[list[int]]:
        """Places t of row b of the (B, T) input -> indices into the packed row. A place
        in the padding reads the row's last real token, and a row that feeds nothing
        reads token 0: their logits are meaningless."""
        def packed(b, t):
            if not self.fed[b]:
                return 0
            return self.starts[b] + min(t, self.fed[b] - 1)

        return [[packed(b, t) for t in row] for b, row in enumerate(places)]

    @staticmethod
    def spread(x, cells, n_rows: int, T: int):
        """Packed (N, ...) -> (n_rows, T, ...): x[i] at flat cell cells[i], zeros
        elsewhere."""
        shape = x.shape[1:]
        out = x.new_zeros(n_rows * T, *shape).index_copy_(0, cells, x)
        return out.view(n_rows, T, *shape)

    def attend(self, layer: int, q, k, v):
        """Write k, v (B, n_kv, T, hd) into the cache, then attend with q
        (B, n_heads, T, hd) over the cached slots -> (B, n_heads, T, hd). In a
        ragged pass B = 1 and T = N: the packed tokens."""
        k_new = k.transpose(1, 2).flatten(0, 1)                   # (N, n_kv, hd)
        v_new = v.transpose(1, 2).flatten(0, 1)
        keys = self.cache.k[layer]
        values = self.cache.v[layer]
        keys[self.rows, :, self.slots] = k_new.to(keys.dtype)
        values[self.rows, :, self.slots] = v_new.to(values.dtype)
        # each group attends over the first S slots of its rows, in the pass's dtype (a cache
        # built from FSDP2's float32 shards holds float32; the pass computes in bfloat16)
        g = q.shape[1] // keys.shape[1]
        for group in self.attention:
            if group[6] is None:
                group[6] = kernel_mask(group[5], g, q.dtype)
        if not self.ragged:
            live, _, _, _, S, _, mask = self.attention[0]
            return attend(q, keys[live, :, :S].to(q.dtype), values[live, :, :S].to(q.dtype),
                          mask)

        # each group spreads its packed queries out to the (B', T) grid of its rows, and back
        q = q[0].transpose(0, 1)                                  # (N, n_heads, hd)
        out = q.new_empty(q.shape)
        for live, tokens, grid, T, S, rows_mask, mask in self.attention:
            k = keys[live, :, :S].to(q.dtype)                     # (B', n_kv, S, hd)
            v = values[live, :, :S].to(q.dtype)
            x = self.spread(q.index_select(0, tokens), grid, len(rows_mask), T)
            y = attend(x.transpose(1, 2), k, v, mask)             # (B', n_heads, T, hd)
            out.index_copy_(0, tokens, y.transpose(1, 2).flatten(0, 1).index_select(0, grid))
        return out[None].transpose(1, 2)                          # (1, n_heads, N, hd)

    def advance(self, T: int):
        """Transformer.forward's call after the last layer: every row's new length, built
        with the plan, so the host need not wait for the layers (T, the packed row's
        length, is not any row's)."""
        self.cache.lengths.copy_(self.lengths)
        self.cache.host_lengths = self.new_lengths
        self.cache.longest = max(self.new_lengths)


def attention_groups(fed: list[int]) -> list[list[int]]:
    """The rows that feed tokens, in one attention group or two. A group attends over a grid of
    (its rows) x (its longest feed) query cells, so one long row (a prompt joining a server's
    batch of one-token rows) would make every row's grid that long: the rows that feed most
    attend apart where that at least halves the cells and they feed 8 tokens or more (a second
    group is a second attention call, dearer than a short feed's few extra cells).

    attention_groups([1, 1, 0, 57, 1]) == [[0, 1, 4], [3]]: 3 + 57 cells, not 4 x 57
    """
    live = [b for b, n in enumerate(fed) if n]
    if len(live) < 2:
        return [live]
    order = sorted(live, key=lambda b: fed[b])
    # (cells, i): the i rows that feed least apart from the others (i = all: one group)
    cells, cut = min((i * fed[order[i - 1]] + (len(order) - i) * fed[order[-1]], i)
                     for i in range(1, len(order) + 1))
    if 2 * cells > len(live) * fed[order[-1]] or fed[order[-1]] < 8:
        return [live]
    short = set(order[:cut])
    return [[b for b in live if b in short], [b for b in live if b not in short]]


def cached_forward(model: Transformer, tokens, cache: DecodeCache, n_tokens=None,
                   output_index=None):
    """model(tokens, cache=cache, output_index=output_index) as one ragged pass: row b feeds
    its first n_tokens[b] tokens (default all T; best a list) at its next slots, and the
    right-padding is never computed (its logits are meaningless). tokens (B, T) and
    output_index (B, N): tensors or, best, lists, which reach the device in the pass's one
    copy (a ragged pass given a tensor output_index reads it from the device) -> logits
    (B, N, V); without output_index (B, T, V)."""
    on_host = not torch.is_tensor(tokens)
    B, T = (len(tokens), len(tokens[0])) if on_host else tokens.shape
    p = RaggedPass(cache, T, n_tokens)
    if p.ragged:
        # the wanted places on the host, then in the packed row (1, N)
        places = [list(range(T))] * B if output_index is None else output_index
        if torch.is_tensor(places):
            places = places.tolist()
        output_index = [list(itertools.chain(*p.packed_places(places)))]
    index_on_host = output_index is not None and not torch.is_tensor(output_index)

    # what the host holds goes with the pass's indices; a ragged pass's tokens packed
    lists = []
    if on_host:
        rows = [row[:n] for row, n in zip(tokens, p.fed)] if p.ragged else tokens
        lists.append(list(itertools.chain(*rows)))
    if index_on_host:
        lists.append(list(itertools.chain(*output_index)))
    uploaded = list(p.upload(*lists))
    if on_host:
        tokens = uploaded.pop(0).view(1 if p.ragged else B, -1)
    elif p.ragged:
        tokens = p.pack(tokens)                                      # (1, N)
    if index_on_host:
        output_index = uploaded.pop(0).view(len(output_index), -1)
    logits = model(tokens, positions=p.positions, cache=p, output_index=output_index)
    return logits.view(B, -1, logits.shape[-1])                      # (B, N or T, V)


# ---- decoding with continuous batching ---------------------------------------------------------
# The cache holds the K/V of every accepted token except the `pending` ones, which
# the next pass feeds: input = pending + (lossless: drafts) + masks, predictions
# from the last pending token on, then a rollback drops masks and rejected drafts.
# Each row has its own cache length and input length (a ragged pass); a finished
# row's place goes to the next waiting prompt (continuous batching).

@dataclass
class Generation:
    """One prompt's continuation, and the tokens each forward pass emitted."""

    # the new tokens (prompt excluded), cut after the first stop token
    tokens: list[int]
    # tokens emitted by each forward pass of this row; sum == len(tokens)
    chunk_sizes: list[int]
    # True: ended on a stop token; False: max_new_tokens or context end
    stopped: bool

    @property
    def forward_passes(self) -> int:
        return len(self.chunk_sizes)

    @property
    def effective_k(self) -> float:
        return len(self.tokens) / max(1, self.forward_passes)

    @property
    def boundaries(self) -> list[int]:
        """End index (into `tokens`) of each chunk: [3, 4, 9] means tokens[0:3],
        [3:4], [4:9]."""
        return list(itertools.accumulate(self.chunk_sizes))


@dataclass
class DecodeStats:
    """What one `generate` call did, over all its rows."""

    mode: str
    # most rows decoded at once
    batch_size: int
    # model calls in the decoding loop (one batched call = one pass)
    forward_passes: int
    # passes summed over rows (== forward_passes at batch size 1)
    row_passes: int
    # new tokens over all rows
    tokens: int
    # tokens / row_passes: tokens one row gains per pass
    effective_k: float
    # positions the decoding passes computed (all rows; padding not computed)
    fed_tokens: int
    # chunk size -> how many passes emitted that many tokens (all rows)
    accept_hist: dict
    # wall time of the whole call, prefill included
    seconds: float
    prefill_seconds: float
    # tokens / decoding seconds (prefill excluded, like effective_k)
    tokens_per_second: float


@dataclass
class Row:
    """One prompt being decoded in a cache row."""

    prompt: list[int]
    # most new tokens (max_new_tokens, capped by the context)
    budget: int
    # accepted, K/V not in the cache yet: fed in the next pass
    pending: list[int]
    # accepted so far
    tokens: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    # lossless: guesses for the tokens after `pending`
    drafts: list[int] = field(default_factory=list)
    done: bool = False
    # this row's rule, where rows of one pass differ (a server's requests); None: the pass's
    mode: DecodeConfig | None = None


def synchronize(device):
    """A timer must read finished GPU work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, cache, prompts, pad_id) -> float:
    """Cache row b starts afresh with prompts[b] (a dict: cache row -> prompt) but
    its last token, its first pending one -> seconds."""
    start = time.perf_counter()
    lengths = list(cache.host_lengths)
    # what each cache row feeds: all of its prompt but the last token (the others: nothing)
    all_but_last = [[] for _ in range(len(cache.lengths))]
    for b, prompt in prompts.items():
        lengths[b] = 0
        all_but_last[b] = prompt[:-1]
    # a row's previous sequence is forgotten
    cache.rollback(lengths)
    # only the cache is wanted: no logits
    if any(all_but_last):
        zeros = [0] * len(all_but_last)
        decode_pass(model, cache, all_but_last, firsts=zeros, n_preds=zeros, pad_id=pad_id)
    synchronize(cache.lengths.device)
    return time.perf_counter() - start


def decode_pass(model, cache, inputs, firsts, n_preds, pad_id):
    """One pass of every row -> logits (B, N, V) at input index firsts[b] ..
    firsts[b] + n_preds[b] - 1 of row b (fewer repeat the last, up to
    N = max(n_preds)). Row b feeds inputs[b] at its own cache slots, right-padded;
    cached_forward skips the padding given the lengths (kept on the host)."""
    T = max(len(x) for x in inputs)
    N = max(n_preds)
    # (B, T): every row right-padded to the longest
    tokens = [x + [pad_id] * (T - len(x)) for x in inputs]
    places = [[f + min(j, n - 1) for j in range(N)] for f, n in zip(firsts, n_preds)]
    n_tokens = [len(x) for x in inputs]
    return cached_forward(model, tokens, cache, n_tokens, output_index=places)   # (B, N, V)


def decode_step(model, cache, batch, mode, mask_id, pad_id, stop_ids):
    """One ragged pass of every Row in `batch`, and what each keeps -> how many
    positions the pass fed."""
    # 1) every row feeds its pending tokens, then drafts and masks, and wants
    # predictions from its last pending token on
    inputs = []
    n_preds = []
    for r in batch:
        wanted = r.budget - len(r.tokens)
        r.drafts, tail = drafts_and_masks(r.mode or mode, r.drafts, wanted, mask_id,
                                          r.prompt + r.tokens)
        inputs.append(r.pending + tail)
        n_preds.append(len(tail) + 1)
    # each row's first prediction is at its last pending token
    firsts = [len(r.pending) - 1 for r in batch]
    logits = decode_pass(model, cache, inputs, firsts=firsts, n_preds=n_preds, pad_id=pad_id)
    # (B, N, V) -> (B, N) each; confidences only for the rule that reads them
    confidences = any((r.mode or mode).kind == "confadapt" for r in batch)
    # a calibrated adapter's confidences (mtp/calibration.py): prediction j at mask slot j
    temperatures = slot_temperatures(model, logits.shape[1])
    preds, confs = top1(logits.float(), mask_id, confidences=confidences,
                        temperatures=temperatures)

    # 2) each row keeps what the accept rule allows. Verified drafts were fed as
    # themselves, so their K/V stays; the other kept tokens become pending.
    for b, (r, n) in enumerate(zip(batch, n_preds)):
        tokens, n_verified, r.drafts = accept(r.mode or mode, preds[b][:n], confs and confs[b][:n],
                                              r.drafts, stop_ids)
        r.tokens += tokens
        r.chunk_sizes.append(len(tokens))
        r.pending = tokens[n_verified:]
        r.done = tokens[-1] in stop_ids or len(r.tokens) >= r.budget

    # 3) the cache forgets the masks and the rejected drafts
    cached = [len(r.prompt) + len(r.tokens) - len(r.pending) for r in batch]
    cache.rollback(cached)
    return sum(len(x) for x in inputs)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int,
             mode: DecodeConfig | None = None, mask_id=None, stop_ids=(),
             batch_size: int | None = None) -> tuple[list[Generation], DecodeStats]:
    """Continue every prompt (token ids) by up to max_new_tokens tokens -> a
    Generation per prompt, ended by its first stop token (kept). At most
    batch_size rows decode at once (default: all)."""
    # 0) refuse what cannot be decoded, before any work
    mode = mode or DecodeConfig()
    mode.validate()
    if mask_id is None:
        mask_id = model.config.mask_token_id
    if mode.block > 1 and mask_id is None:
        raise ValueError(f"{mode.describe()} needs a <mask> token, and the model has "
                         "none (only greedy works)")
    check_slots(model, mode.block)
    context = model.config.max_seq_len
    for p in prompts:
        if not p:
            raise ValueError("empty prompt: give at least one token (e.g. BOS)")
        if len(p) >= context:
            raise ValueError(f"prompt of {len(p)} tokens does not fit the context "
                             f"of {context} tokens")
    if max_new_tokens < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError("max_new_tokens and batch_size must be at least 1, "
                         f"got {max_new_tokens}, {batch_size}")
    stop_ids = set(stop_ids)
    # padding is never computed: any id does
    pad_id = mask_id or 0

    # 1) prefill the first batch_size prompts; the others wait for a free cache row
    start = time.perf_counter()
    rows = [Row(list(p), budget=min(max_new_tokens, context - len(p)), pending=[p[-1]])
            for p in prompts]
    width = min(batch_size or len(rows), len(rows))
    # room for the longest row, and one pass beyond it
    length = max(len(r.prompt) + r.budget for r in rows) + 2 * mode.block
    cache = new_cache(model, width, length)
    # cache row b decodes rows[active[b]]
    active = list(range(width))
    waiting = list(range(width, len(rows)))
    prefill(model, cache, {b: rows[i].prompt for b, i in enumerate(active)}, pad_id)
    # setting up counts as prefill
    prefill_s = time.perf_counter() - start

    passes = 0
    fed = 0
    while active:
        # 2) one ragged pass of every active row; each keeps what the accept rule allows
        batch = [rows[i] for i in active]
        fed += decode_step(model, cache, batch, mode, mask_id=mask_id, pad_id=pad_id,
                           stop_ids=stop_ids)
        passes += 1

        # 3) continuous batching: a finished row hands its cache row to the next
        # waiting prompt, or with none left leaves the batch
        joining = {b: waiting.pop(0) for b, i in enumerate(active) if rows[i].done and waiting}
        active = [joining.get(b, i) for b, i in enumerate(active)]
        if joining:
            starting = {b: rows[active[b]].prompt for b in joining}
            prefill_s += prefill(model, cache, starting, pad_id)
        still = [b for b, i in enumerate(active) if not rows[i].done]
        if len(still) < len(active) and still:
            cache.keep_rows(still)
        active = [active[b] for b in still]
    seconds = time.perf_counter() - start

    # 4) each prompt's tokens, and what the whole call did
    gens = [Generation(r.tokens, r.chunk_sizes, stopped=r.tokens[-1] in stop_ids)
            for r in rows]
    n_tokens = sum(len(g.tokens) for g in gens)
    row_passes = sum(g.forward_passes for g in gens)
    hist = Counter(n for g in gens for n in g.chunk_sizes)
    stats = DecodeStats(mode.describe(),
                        batch_size=width,
                        forward_passes=passes,
                        row_passes=row_passes,
                        tokens=n_tokens,
                        effective_k=n_tokens / max(1, row_passes),
                        fed_tokens=fed,
                        accept_hist=dict(sorted(hist.items())),
                        seconds=seconds,
                        prefill_seconds=prefill_s,
                        tokens_per_second=n_tokens / max(seconds - prefill_s, 1e-9))
    return gens, stats


# ---- counting the waits for the device --------------------------------------------------------

@torch.inference_mode()
def time_passes(model, shapes, context=128) -> dict:
    """{(k, B): seconds} of one cached pass of k new positions in each of B rows over
    `context` cached tokens, for each (k, B) of `shapes`, on an idle machine (serve.py's
    start-up costs)."""
    seconds = {}
    for k, b in shapes:
        n = min(context, model.config.max_seq_len - k - 1)
        cache = new_cache(model, b, n + k)
        times = []
        # the first pass of a shape is slow: the best of the next two
        for _ in range(3):
            # every row holds n tokens (zeros: the time is the same)
            cache.rollback(0)
            cache.advance(n)
            start = time.perf_counter()
            decode_pass(model, cache, [[0] * k] * b, [0] * b, [k] * b, pad_id=0)
            synchronize(cache.lengths.device)
            times.append(time.perf_counter() - start)
        seconds[k, b] = min(times[1:])
    return seconds


class HostSyncs(TorchDispatchMode):
    """Count, by kind, the operations that make the host wait for the device.

    On a GPU each of them waits until all queued work is done: reading a value (.item(), int(),
    bool(), `if tensor:`), .tolist(), and every operation whose output size depends on the data
    (nonzero, masked_select, indexing with a boolean mask). So does a tensor made from Python
    data (torch.tensor(list), torch.as_tensor(list): "upload"), a copy from pageable host memory
    that the device's queue waits for. They are counted on any device, so a CPU run shows what a
    GPU run would wait for. (.tolist() is counted by name: code that keeps host data in Python
    lists never calls it on a host tensor.)
    """

    def __enter__(self):
        self.counts = Counter()
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: (self.counts.update(["tolist"]), self._tolist(t))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default):
            self.counts["item"] += 1
        elif func is aten.lift_fresh.default and args[0].dim() > 0:
            # (a Python number, 0-dimensional, reaches a kernel as its argument: no copy)
            self.counts["upload"] += 1
        elif func in (aten.nonzero.default, aten.masked_select.default):
            self.counts[func.__name__.split(".")[0]] += 1
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.counts["boolean index"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def syncs_per_pass(model, prompts, max_new_tokens, mode, **kwargs) -> tuple[list[int], DecodeStats]:
    """generate(model, prompts, max_new_tokens, mode, **kwargs) with the host syncs of each
    decoding pass counted (HostSyncs around every decode_step) -> (each pass's count, stats)."""
    global decode_step
    step = decode_step
    per_pass = []

    def counted(*args, **kw):
        with HostSyncs() as syncs:
            fed = step(*args, **kw)
        per_pass.append(syncs.total)
        return fed

    decode_step = counted
    try:
        _, stats = generate(model, prompts, max_new_tokens, mode, **kwargs)
    finally:
        decode_step = step
    return per_pass, stats
