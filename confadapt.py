"""Decoding a multi-token model: static k, ConfAdapt and a lossless mode, with a KV cache and batching.

An MTP model (model.py, trained by distill.py) predicts several tokens in one forward pass: feed
the text so far followed by k-1 `<mask>` tokens, and the logits at the last real token and at the
k-1 masks are k predictions. How many of them to keep is the decoding rule:

    static k          keep all k predictions of every pass (greedy: k = 1).
    ConfAdapt(tau, k) keep the longest leading run whose top-1 probability is at least tau, never
                      fewer than one (the paper's main decoding rule).
    lossless          mask predictions are only drafts, checked by the model's own next-token
                      predictions in the next pass: exactly plain greedy output, in fewer passes.

`generate_uncached` defines the rules for one prompt, no cache; `generate` adds a KV cache and
batching, same output (tests/test_confadapt.py). Effective k = tokens / passes is not a speed-up: a
pass reading 2k-1 tokens costs more than one reading 1 (benchmarks/bench_modes.py measures both).

Run:  python confadapt.py --model DIR --prompt "1 2 3" [--tau 0.9 --k-max 16 | --static-k 4 | --lossless]
References: MTP via Self-Distillation (arXiv 2602.06019); lossless: blockwise parallel decoding (arXiv 1811.03115).
"""

import itertools
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from cli import (CliError, Parser, add_model_args, chat_stop_ids, encode_prompt, load,
                 output_folder, positive_int, probability, prompt_format, run_cli)

MODES = ("greedy", "static", "confadapt", "lossless")

@dataclass
class DecodeConfig:
    """Which decoding rule to use and how many predictions one pass may make."""
    kind: str = "confadapt"   # "greedy" | "static" | "confadapt" | "lossless"
    k: int = 4                # static: tokens per pass; lossless: most per pass (1 + k-1 drafts)
    tau: float = 0.9          # confadapt: confidence threshold, in (0, 1]
    k_max: int = 16           # confadapt: most tokens per pass

    @property
    def block(self) -> int:                   # predictions per pass: at the last real token, then masks
        return {"greedy": 1, "static": self.k, "confadapt": self.k_max, "lossless": self.k}[self.kind]
    def validate(self):
        if self.kind not in MODES:
            raise ValueError(f"unknown decoding mode {self.kind!r}; choose one of {', '.join(MODES)}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"threshold tau must be in (0, 1], got {self.tau}")
        if self.k < 1 or self.k_max < 1:
            raise ValueError(f"k must be at least 1, got k={self.k}, k_max={self.k_max}")
    def describe(self) -> str:
        return {"greedy": "greedy", "static": f"static k={self.k}", "lossless": f"lossless k={self.k}",
                "confadapt": f"confadapt tau={self.tau:g} k_max={self.k_max}"}[self.kind]

def decode_modes(static_ks=(), taus=(), k_max: int = 16,
                 lossless_k: int | None = None) -> list[DecodeConfig]:
    """A decoding sweep: static k per k (k=1 is greedy), ConfAdapt per tau, lossless."""
    modes = [DecodeConfig("greedy") if k == 1 else DecodeConfig("static", k=k) for k in static_ks]
    modes += [DecodeConfig("confadapt", tau=t, k_max=k_max) for t in taus]
    modes += [DecodeConfig("lossless", k=lossless_k)] if lossless_k else []
    for m in modes:
        m.validate()
    return modes

# --- The definition: the accept rules, and one prompt decoded without a cache -------------------

def accept_confadapt(confidences: list[float], tau: float) -> int:
    """ConfAdapt: the longest leading run of predictions with top-1 probability >= tau, at least 1.
    tau = 1.0 keeps only the first (the ordinary next token): float32 softmax rounds anything within
    ~6e-8 of 1 to 1.0, so `>= 1.0` read literally would accept mask guesses greedy need not make."""
    if tau >= 1.0:
        return 1
    return max(1, next((i for i, c in enumerate(confidences) if c < tau), len(confidences)))

def verify_drafts(drafts: list[int], predictions: list[int]) -> int:
    """Lossless: how many leading drafts are greedy's tokens. predictions[i], the argmax just before
    drafts[i], is greedy's token there when all earlier drafts were: count the leading matches."""
    return next((i for i, (d, p) in enumerate(zip(drafts, predictions)) if d != p), len(drafts))

def accept(mode: DecodeConfig, preds: list[int], confs: list[float] | None, drafts: list[int], stop_ids):
    """One pass's accept rule -> (accepted tokens, how many of them were fed as drafts, next drafts).
    preds/confs: argmax and its probability at the last real token, then at each draft and mask.
    Lossless keeps the `a` verified drafts plus preds[a], the model's own token after them: each
    kept token is the argmax given greedy text, i.e. what greedy emits. The mask predictions become
    the next drafts only if every draft held. A stop token ends the chunk and is kept."""
    tokens, verified, next_drafts = preds, 0, []                     # greedy, static k: keep all
    if mode.kind == "confadapt":
        tokens = preds[: accept_confadapt(confs, mode.tau)]
    elif mode.kind == "lossless":
        verified = verify_drafts(drafts, preds[: len(drafts)])
        tokens = preds[: verified + 1]
        next_drafts = preds[len(drafts) + 1:] if verified == len(drafts) else []
    stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return (tokens if stop is None else tokens[: stop + 1]), verified, next_drafts

def top1(mode: DecodeConfig, logits: torch.Tensor, mask_id=None) -> tuple[list, list | None]:
    """The top prediction at each place (and its probability, for ConfAdapt). <mask> is an input,
    never an output: fed back, it would be read as a mask slot."""
    if mask_id is not None:
        logits[..., mask_id] = float("-inf")
    if mode.kind != "confadapt":
        return logits.argmax(-1).tolist(), None
    confs, preds = logits.softmax(-1).max(-1)
    return preds.tolist(), confs.tolist()

def pass_tail(mode: DecodeConfig, drafts: list[int], wanted: int, mask_id) -> tuple[list[int], list[int]]:
    """(drafts, drafts + masks) to feed after the last real token: at most `wanted` predictions."""
    drafts = drafts[: wanted - 1]
    return drafts, drafts + [mask_id] * min(mode.block - 1, wanted - 1 - len(drafts))

@torch.no_grad()
def generate_uncached(model, prompt: list[int], max_new_tokens: int, mode: DecodeConfig, mask_id=None,
                      stop_ids=()) -> tuple[list[int], list[int]]:
    """Every mode by definition, batch size 1, no cache: each pass runs the whole text + drafts +
    masks. Returns (new tokens, tokens kept per pass); `generate` returns the same."""
    mask_id = model.config.mask_token_id if mask_id is None else mask_id
    budget = min(max_new_tokens, model.config.max_seq_len - len(prompt))
    out, chunks, drafts = [], [], []
    while len(out) < budget and not (out and out[-1] in stop_ids):
        drafts, tail = pass_tail(mode, drafts, wanted=budget - len(out), mask_id=mask_id)
        x = torch.tensor([prompt + out + tail], device=next(model.parameters()).device)
        logits = model(x)[0, len(prompt) + len(out) - 1:].float()    # (1 + len(tail), V): the predictions
        preds, confs = top1(mode, logits, mask_id)
        new, _, drafts = accept(mode, preds, confs, drafts=drafts, stop_ids=stop_ids)
        out += new
        chunks.append(len(new))
    return out, chunks

# --- The same with a KV cache, ragged passes and continuous batching ---------------------------
# The cache (model.KVCache) holds the K/V of every accepted token except the `pending` ones, which
# the next pass feeds: input = pending + (lossless: drafts) + masks, predictions from the last
# pending token on, then a rollback drops masks and rejected drafts. Each row has its own cache
# length and input length (a ragged pass); a finished row's place goes to the next waiting prompt
# (continuous batching). A row's output is the one it gets alone, up to float rounding.

@dataclass
class Generation:
    tokens: list[int]          # the new tokens (prompt excluded), cut after the first stop token
    chunk_sizes: list[int]     # tokens emitted by each forward pass of this row; sum == len(tokens)
    stopped: bool              # True: ended on a stop token; False: max_new_tokens or context end

    @property
    def forward_passes(self) -> int:
        return len(self.chunk_sizes)
    @property
    def effective_k(self) -> float:
        return len(self.tokens) / max(1, self.forward_passes)
    @property
    def boundaries(self) -> list[int]:
        """End index (into `tokens`) of each chunk: [3, 4, 9] means tokens[0:3], [3:4], [4:9]."""
        return list(itertools.accumulate(self.chunk_sizes))

@dataclass
class DecodeStats:
    mode: str
    batch_size: int             # most rows decoded at once
    forward_passes: int         # model calls in the decoding loop (one batched call = one pass)
    row_passes: int             # passes summed over rows (== forward_passes at batch size 1)
    tokens: int                 # new tokens over all rows
    effective_k: float          # tokens / row_passes: tokens one row gains per pass
    fed_tokens: int             # positions the decoding passes computed (all rows; padding not computed)
    accept_hist: dict           # chunk size -> how many passes emitted that many tokens (all rows)
    seconds: float              # wall time of the whole call, prefill included
    prefill_seconds: float
    tokens_per_second: float    # tokens / decoding seconds (prefill excluded, like effective_k)

@dataclass
class Row:
    prompt: list[int]
    budget: int                                         # most new tokens (max_new_tokens, capped by context)
    pending: list[int]                                  # accepted, K/V not in the cache yet: fed next pass
    tokens: list[int] = field(default_factory=list)     # accepted so far
    chunk_sizes: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)     # lossless: guesses for the tokens after `pending`
    done: bool = False

def synchronize(device):                  # a timer must read finished GPU work (no-op on the CPU)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def prefill(model, cache, prompts: dict[int, list[int]], pad_id: int) -> float:
    """Cache row b starts afresh with prompts[b] but its last token (its first pending one); seconds."""
    start = time.perf_counter()
    lengths, heads = cache.lengths.clone(), [[] for _ in range(len(cache.lengths))]
    for b, prompt in prompts.items():
        lengths[b], heads[b] = 0, prompt[:-1]
    cache.rollback(lengths)                                  # a row's previous sequence is forgotten
    if any(heads):                                           # only the cache is wanted: no logits
        zeros = [0] * len(heads)
        decode_pass(model, cache, heads, firsts=zeros, n_preds=zeros, pad_id=pad_id)
    synchronize(cache.lengths.device)
    return time.perf_counter() - start

def decode_pass(model, cache, inputs: list[list[int]], firsts: list[int], n_preds: list[int], pad_id: int):
    """One pass of every row -> logits (B, N, V) at input index firsts[b] .. firsts[b] + n_preds[b] - 1
    of row b (fewer repeat the last, up to N = max(n_preds)). Row b feeds inputs[b] at its own cache
    slots, right-padded; model.forward skips the padding given the lengths (kept on the host)."""
    device, T, N = cache.lengths.device, max(len(x) for x in inputs), max(n_preds)
    tokens = torch.tensor([x + [pad_id] * (T - len(x)) for x in inputs], device=device)      # (B, T)
    n_tokens = [len(x) for x in inputs] if any(len(x) != T for x in inputs) else None
    index = torch.tensor([[f + min(j, n - 1) for j in range(N)] for f, n in zip(firsts, n_preds)],
                         dtype=torch.long, device=device)                                     # (B, N)
    return model(tokens, cache=cache, output_index=index, n_tokens=n_tokens)                 # (B, N, V)

@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, mode: DecodeConfig | None = None, mask_id=None,
             stop_ids=(), batch_size: int | None = None) -> tuple[list[Generation], DecodeStats]:
    """Continue every prompt (token ids) by up to max_new_tokens tokens -> a Generation per prompt,
    ended by its first stop token (kept). At most batch_size rows decode at once (default: all)."""
    mode = mode or DecodeConfig()
    mode.validate()
    mask_id = model.config.mask_token_id if mask_id is None else mask_id
    if mode.block > 1 and mask_id is None:
        raise ValueError(f"{mode.describe()} needs a <mask> token, and the model has none (only greedy works)")
    context = model.config.max_seq_len
    for p in prompts:
        if not p:
            raise ValueError("empty prompt: give at least one token (e.g. BOS)")
        if len(p) >= context:
            raise ValueError(f"prompt of {len(p)} tokens does not fit the context of {context} tokens")
    if max_new_tokens < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError(f"max_new_tokens and batch_size must be at least 1, got {max_new_tokens}, {batch_size}")
    stop_ids, pad_id = set(stop_ids), 0 if mask_id is None else mask_id    # padding is never computed: any id

    # 1) prefill the first batch_size prompts; the others wait for a free cache row
    start = time.perf_counter()
    rows = [Row(list(p), budget=min(max_new_tokens, context - len(p)), pending=[p[-1]]) for p in prompts]
    width = min(batch_size or len(rows), len(rows))
    cache = model.new_cache(width, max(len(r.prompt) + r.budget for r in rows) + 2 * mode.block)  # + one pass
    active, waiting = list(range(width)), list(range(width, len(rows)))    # cache row b decodes rows[active[b]]
    prefill(model, cache, {b: rows[i].prompt for b, i in enumerate(active)}, pad_id)
    prefill_s, passes, fed = time.perf_counter() - start, 0, 0             # setting up counts as prefill
    while active:
        # 2) one ragged pass: every row feeds its pending tokens, then drafts and masks
        batch, inputs = [rows[i] for i in active], []
        for r in batch:
            wanted = r.budget - len(r.tokens)
            r.drafts, tail = pass_tail(mode, r.drafts, wanted=wanted, mask_id=mask_id)
            inputs.append(r.pending + tail)
        n_preds = [len(x) - len(r.pending) + 1 for x, r in zip(inputs, batch)]
        passes, fed = passes + 1, fed + sum(len(x) for x in inputs)
        firsts = [len(r.pending) - 1 for r in batch]       # each row's last pending token
        logits = decode_pass(model, cache, inputs, firsts=firsts, n_preds=n_preds, pad_id=pad_id)
        preds, confs = top1(mode, logits.float(), mask_id)         # (B, N, V) -> (B, N) each
        # 3) each row keeps what the accept rule allows. Verified drafts were fed as themselves,
        # so their K/V stays; the other kept tokens become pending; masks and rejected drafts go.
        for b, (r, n) in enumerate(zip(batch, n_preds)):
            tokens, in_cache, r.drafts = accept(mode, preds[b][:n], confs and confs[b][:n],
                                                drafts=r.drafts, stop_ids=stop_ids)
            r.tokens += tokens
            r.chunk_sizes.append(len(tokens))
            r.pending = tokens[in_cache:]
            r.done = tokens[-1] in stop_ids or len(r.tokens) >= r.budget
        cache.rollback(torch.tensor([len(r.prompt) + len(r.tokens) - len(r.pending) for r in batch],
                                    device=cache.lengths.device))
        # 4) a finished row hands its cache row to the next waiting prompt, or with none left leaves
        joining = {b: waiting.pop(0) for b, r in enumerate(batch) if r.done and waiting}  # b -> new row
        active = [joining.get(b, i) for b, i in enumerate(active)]
        if joining:
            prefill_s += prefill(model, cache, {b: rows[active[b]].prompt for b in joining}, pad_id)
        still = [b for b, i in enumerate(active) if not rows[i].done]
        if len(still) < len(active) and still:
            cache.keep_rows(still)
        active = [active[b] for b in still]
    seconds = time.perf_counter() - start
    gens = [Generation(r.tokens, r.chunk_sizes, stopped=r.tokens[-1] in stop_ids) for r in rows]
    n_tokens, row_passes = sum(len(g.tokens) for g in gens), sum(g.forward_passes for g in gens)
    hist = dict(sorted(Counter(n for g in gens for n in g.chunk_sizes).items()))
    return gens, DecodeStats(mode.describe(), width, passes, row_passes, n_tokens, n_tokens / max(1, row_passes), fed,
                             hist, seconds, prefill_s, n_tokens / max(seconds - prefill_s, 1e-9))

# --- Showing the chunks (the paper's Figure 1): one colour run per forward pass ----------------

def chunk_texts(tokenizer, tokens: list[int], chunk_sizes: list[int]) -> list[str]:
    """The text of each chunk, decoded as prefixes: a character split across chunks lands whole in
    the chunk that completes it."""
    texts, done = [], ""
    for n, end in zip(chunk_sizes, itertools.accumulate(chunk_sizes)):
        full = tokenizer.decode(tokens[:end])
        texts.append(full[len(done):] if full.startswith(done) else tokenizer.decode(tokens[end - n:end]))
        done = full
    return texts

BACKGROUNDS, PNG_COLOURS = ("\x1b[30;48;5;153m", "\x1b[30;48;5;223m"), ("#b9d9f5", "#fbd8a8")  # blue, orange

def render_chunks(prompt_text: str, texts: list[str], sizes: list[int], colour: bool = True) -> str:
    """Prompt, then each chunk on an alternating background followed by its size as a dim
    subscript (the number of tokens that pass emitted). Without colour, chunks are bracketed."""
    out = [prompt_text]
    for i, (text, n) in enumerate(zip(texts, sizes)):
        sub = str(n).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))
        body = "\n".join(f"{BACKGROUNDS[i % 2]}{line}\x1b[0m" if line else "" for line in text.split("\n"))
        out.append(f"{body}\x1b[2m{sub}\x1b[0m" if colour else f"[{text}]{sub}")
    return "".join(out)

def save_chunks_png(path: str, prompt_text: str, texts: list[str], sizes: list[int], title: str = "", width=80):
    """The same as a PNG: a monospace grid wrapped at spaces, each chunk's size above its start."""
    from matplotlib import figure, patches
    chars = [(ch, chunk) for chunk, text in [(-1, prompt_text)] + list(enumerate(texts))
             for ch in text.replace("\t", "    ")]
    cells, row, col, wrapped = [], 0, 0, False    # cells: (row, col, char, chunk index or -1 for prompt)
    for i, (ch, chunk) in enumerate(chars):
        word = 0                                 # a word starting here: wrap before it unless it fits
        if ch not in " \n" and col > 0 and chars[i - 1][0] == " ":
            word = next((j for j in range(i, len(chars)) if chars[j][0] in " \n"), len(chars)) - i
        if ch == "\n" or col >= width or col + word > width:          # a longer word is cut
            row, col, wrapped = row + 1, 0, ch != "\n"
        if ch != "\n" and not (ch == " " and col == 0 and wrapped):  # a wrapped line skips spaces
            cells.append((row, col, ch, chunk))
            col += 1
    n_cols, line_h = max((c for _, c, _, _ in cells), default=0) + 1, 1.6
    ax = figure.Figure(figsize=(n_cols * 0.11 + 0.4, (row + 1) * 0.26 + 0.6)).subplots()
    for i, (r, c, ch, chunk) in enumerate(cells):
        if chunk >= 0:
            ax.add_patch(patches.Rectangle((c, -r * line_h - 0.55), 1, 1.3, color=PNG_COLOURS[chunk % 2], lw=0))
        ax.text(c + 0.5, -r * line_h, ch, ha="center", va="center", family="monospace", fontsize=9,
                parse_math=False, color="#666666" if chunk < 0 else "black")
        if chunk >= 0 and (i == 0 or cells[i - 1][3] != chunk):      # a chunk's first character
            ax.text(c + 0.1, -r * line_h + 0.75, str(sizes[chunk]), fontsize=4.5, color="#444444", va="bottom")
    ax.set(xlim=(-0.5, n_cols + 0.5), ylim=(-row * line_h - 1.2, 1.4))
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")
    ax.figure.savefig(path, dpi=150, bbox_inches="tight")

# --- The command line: one prompt, decoded and shown ------------------------------------------

def generate_main(argv):
    p = Parser(prog="confadapt.py", description="Multi-token decoding of an MTP model with a KV cache.")
    add_model_args(p)
    d = p.add_argument_group("decoding (default: ConfAdapt tau=0.9, k_max=16)")
    d.add_argument("--prompt", required=True, help="the text to continue")
    d.add_argument("--max-new-tokens", type=positive_int, default=128, help="most tokens to generate")
    d.add_argument("--tau", type=probability, help="ConfAdapt confidence threshold in (0, 1] (default 0.9)")
    d.add_argument("--k-max", type=positive_int, help="ConfAdapt / lossless: most tokens per pass (default 16)")
    one = d.add_mutually_exclusive_group()
    one.add_argument("--static-k", type=positive_int, help="static k: keep all k predictions of every pass")
    one.add_argument("--lossless", action="store_true", help="verify mask drafts: output == plain greedy")
    one.add_argument("--greedy", action="store_true", help="plain greedy, one token per pass")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    o.add_argument("--png", default=None, help="also draw the chunks into this PNG file")
    o.add_argument("--color", default="auto", choices=["auto", "always", "never"], help="colour the chunks")
    args = p.parse_args(argv)
    if args.png:
        output_folder(os.path.dirname(args.png) or ".", f"--png {args.png}: its folder")
    kind = ("greedy" if args.greedy else "static" if args.static_k is not None
            else "lossless" if args.lossless else "confadapt")
    if kind != "confadapt" and args.tau is not None:
        raise CliError("--tau applies to ConfAdapt only (not with --static-k, --lossless or --greedy)")
    if kind in ("greedy", "static") and args.k_max is not None:
        raise CliError("--k-max applies to ConfAdapt and --lossless only")
    k_max = 16 if args.k_max is None else args.k_max
    mode = DecodeConfig(kind, k=args.static_k or k_max, tau=0.9 if args.tau is None else args.tau, k_max=k_max)
    model, tokenizer, mask_id, stop_ids = load(args, mode)
    fmt = prompt_format(args.format, tokenizer, model)
    stop_ids = chat_stop_ids(stop_ids, tokenizer, fmt)
    prompt = encode_prompt(tokenizer, model, args.prompt, fmt, no_bos=args.no_bos)
    # an untimed warm-up: first calls are slow
    generate(model, [prompt[-8:]], 2, mode=mode, mask_id=mask_id)
    [gen], s = generate(model, [prompt], args.max_new_tokens, mode=mode, mask_id=mask_id,
                        stop_ids=stop_ids)
    texts = chunk_texts(tokenizer, gen.tokens, gen.chunk_sizes)
    if args.json:
        keys = "mode forward_passes effective_k seconds prefill_seconds tokens_per_second accept_hist".split()
        print(json.dumps({"text": "".join(texts), "tokens": gen.tokens, "prompt_tokens": len(prompt),
                          **{key: getattr(s, key) for key in keys}, "chunk_sizes": gen.chunk_sizes,
                          "chunk_ends": gen.boundaries, "chunks": texts, "stopped": gen.stopped}))
    else:
        colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
        print(render_chunks(args.prompt, texts, gen.chunk_sizes, colour=colour), "",
              f"mode            {s.mode}\ntokens          {s.tokens}\n"
              f"forward passes  {s.forward_passes} (the prefill not counted)\n"
              f"effective k     {s.effective_k:.2f} tokens/pass\n"
              f"positions fed   {s.fed_tokens} ({s.fed_tokens / max(1, s.tokens):.2f} per token)\n"
              f"accepted/pass   {' '.join(f'{n}:{c}' for n, c in s.accept_hist.items())}\n"
              f"wall time       {s.seconds:.3f} s (prefill {s.prefill_seconds:.3f} s)\n"
              f"tokens/second   {s.tokens_per_second:.1f} (decoding)\nchunk ends      {gen.boundaries}", sep="\n")
    context_full = not gen.stopped and len(gen.tokens) < args.max_new_tokens
    if context_full:
        context = model.config.max_seq_len
        print(f"note: stopped at the end of the model's context ({context} tokens)", file=sys.stderr)
    if args.png:
        os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
        save_chunks_png(args.png, args.prompt, texts, gen.chunk_sizes, title=f"{s.mode}: {s.tokens} tokens in "
                        f"{s.forward_passes} passes (effective k {s.effective_k:.2f})")

def main(argv=None) -> int:
    return run_cli(generate_main, sys.argv[1:] if argv is None else list(argv))

if __name__ == "__main__":
    sys.exit(main())
