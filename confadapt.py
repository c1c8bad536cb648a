"""Decoding a multi-token model: static k, ConfAdapt and a lossless mode.

An MTP model (model.py, trained by distill.py) predicts several tokens in one
forward pass: feed the text so far followed by k-1 `<mask>` tokens, and the
logits at the last real token and at the k-1 masks are k predictions. How many
of them to keep is the decoding rule:

    static k          keep all k predictions of every pass (greedy: k = 1).
    ConfAdapt(tau, k) keep the longest leading run whose top-1 probability is
                      at least tau, never fewer than one (the paper's main rule).
    lossless          mask predictions are only drafts, checked by the model's
                      own next-token predictions in the next pass: exactly plain
                      greedy output, in fewer passes. With lookup, a pass the
                      masks left without drafts (the last ones failed) copies
                      them from earlier in the text instead (prompt lookup).

The file reads in order: the rules and `generate_uncached`, their definition for
one prompt without a cache; then `generate`, the same output for a batch of
prompts with a KV cache; then the command line. The command decodes with
mtp/engine.py, which adds ragged passes and continuous batching for speed
(tests/test_confadapt.py holds both cached decoders to the definition).
Effective k = tokens / passes is not a speed-up: a pass reading 2k-1 tokens
costs more than one reading 1 (benchmarks/bench_modes.py measures both).

Run:
    python confadapt.py --model DIR --prompt "1 2 3" \\
        [--tau 0.9 --k-max 16 | --static-k 4 | --lossless [--lookup]]

References: MTP via Self-Distillation (arXiv 2602.06019);
lossless: blockwise parallel decoding (arXiv 1811.03115).
"""

import json
import os
import sys
from dataclasses import dataclass

import torch

from mtp.calibration import slot_temperatures
from mtp.chunks import chunk_texts, render_chunks, save_chunks_png
from mtp.cli import (CliError, Parser, add_model_args, chat_stop_ids, check_model_folder,
                     encode_prompt, exactness, load, output_folder, positive_int,
                     probability, prompt_format, run_cli)

RULES = ("static", "confadapt", "lossless")


@dataclass
class DecodeConfig:
    """Which decoding rule to use (`kind`, one of RULES) and how many predictions
    one pass may make. Greedy is static k = 1: DecodeConfig("static", k=1)."""

    kind: str = "confadapt"
    # static: tokens per pass; lossless: most per pass (1 + k-1 drafts)
    k: int = 4
    # confadapt: the confidence threshold, in (0, 1]
    tau: float = 0.9
    # confadapt: most tokens per pass
    k_max: int = 16
    # lossless: drafts from earlier in the text where the masks offer none
    lookup: bool = False

    @property
    def block(self) -> int:
        """Predictions per pass: at the last real token, then at the masks."""
        if self.kind == "confadapt":
            return self.k_max
        return self.k

    def validate(self):
        if self.kind not in RULES:
            raise ValueError(f"unknown decoding rule {self.kind!r}; "
                             f"choose one of {', '.join(RULES)}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"threshold tau must be in (0, 1], got {self.tau}")
        if self.k < 1 or self.k_max < 1:
            raise ValueError(f"k must be at least 1, got k={self.k}, k_max={self.k_max}")

    def describe(self) -> str:
        if self.kind == "static" and self.k == 1:
            return "greedy"
        return {
            "static": f"static k={self.k}",
            "lossless": f"lossless k={self.k}" + (" + lookup" if self.lookup else ""),
            "confadapt": f"confadapt tau={self.tau:g} k_max={self.k_max}"
        }[self.kind]


def decode_modes(static_ks=(), taus=(), k_max=16, lossless_k=None):
    """A decoding sweep -> DecodeConfigs: static k per k (k=1 is greedy), ConfAdapt
    per tau, lossless."""
    modes = [DecodeConfig("static", k=k) for k in static_ks]
    modes += [DecodeConfig("confadapt", tau=t, k_max=k_max) for t in taus]
    if lossless_k:
        modes.append(DecodeConfig("lossless", k=lossless_k))
    for m in modes:
        m.validate()
    return modes


# --- The definition: the accept rules, and one prompt decoded without a cache ---

def accept_confadapt(confidences: list[float], tau: float) -> int:
    """ConfAdapt: the longest leading run of predictions with top-1 probability
    >= tau, at least 1. tau = 1.0 keeps only the first (the ordinary next token):
    float32 softmax rounds anything within ~6e-8 of 1 to 1.0, so `>= 1.0` read
    literally would accept mask guesses greedy need not make."""
    if tau >= 1.0:
        return 1
    below = (i for i, c in enumerate(confidences) if c < tau)
    return max(1, next(below, len(confidences)))


def verify_drafts(drafts: list[int], predictions: list[int]) -> int:
    """Lossless: how many leading drafts are greedy's tokens. predictions[i], the
    argmax just before drafts[i], is greedy's token there when all earlier drafts
    were: count the leading matches."""
    misses = (i for i, (d, p) in enumerate(zip(drafts, predictions)) if d != p)
    return next(misses, len(drafts))


def accept(mode: DecodeConfig, preds: list[int], confs: list[float],
           drafts: list[int], stop_ids):
    """One pass's accept rule -> (accepted tokens, n_verified, next drafts).
    preds/confs: the argmax and its probability at the last real token, then at
    each draft and mask. n_verified: how many accepted tokens are drafts the pass
    fed (so their keys and values are already right)."""
    # The accept rules:
    #   static k (greedy: k = 1): keep every prediction.
    #   ConfAdapt: keep the leading run with confidence >= tau, at least one.
    #   lossless: keep the n_verified drafts plus preds[n_verified], the model's
    #   own token after them: each is the argmax given greedy's text, so greedy's
    #   token. The mask predictions become the next drafts only if every draft held.
    # In every mode a stop token ends the chunk, and is kept.
    tokens = preds
    n_verified = 0
    next_drafts = []
    if mode.kind == "confadapt":
        tokens = preds[: accept_confadapt(confs, mode.tau)]
    elif mode.kind == "lossless":
        n_verified = verify_drafts(drafts, preds[: len(drafts)])
        tokens = preds[: n_verified + 1]
        if n_verified == len(drafts):
            next_drafts = preds[len(drafts) + 1:]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    return tokens, n_verified, next_drafts


def top1(logits, mask_id=None, confidences=True, temperatures=None) -> tuple[list, list | None]:
    """The top prediction at each place, and its probability (None unless asked
    for: reading it waits for the device once more). <mask> is an input, never an
    output: fed back, it would read as a mask slot. temperatures: place j's probability
    is under softmax(logits / temperatures[j]) (mtp/calibration.py)."""
    if mask_id is not None:
        logits[..., mask_id] = float("-inf")
    confs, preds = logits.softmax(-1).max(-1)
    if temperatures is not None and confidences:
        scaled = (logits / temperatures[: logits.shape[-2], None]).softmax(-1)
        confs = scaled.gather(-1, preds[..., None])[..., 0]
    return preds.tolist(), confs.tolist() if confidences else None


def drafts_and_masks(mode, drafts, wanted, mask_id, text=()):
    """What a pass feeds after the last real token, for at most `wanted`
    predictions -> (the drafts it keeps, those drafts followed by masks). text:
    the prompt and the tokens so far, where lookup copies drafts from."""
    if mode.lookup and not drafts:
        drafts = lookup_drafts(text, mode.block - 1)
    drafts = drafts[: wanted - 1]
    n_masks = min(mode.block - 1, wanted - 1 - len(drafts))
    return drafts, drafts + [mask_id] * n_masks


def lookup_drafts(text, n: int, longest: int = 2) -> list[int]:
    """Prompt lookup: the n tokens that followed the latest earlier place where the
    text's last `longest` tokens (else fewer) appeared. Word problems repeat their
    numbers and names; a draft costs a position, never a wrong token."""
    text = list(text)
    for size in range(min(longest, len(text) - 1), 0, -1):
        tail = text[-size:]
        for start in range(len(text) - size - 1, -1, -1):
            if text[start:start + size] == tail:
                return text[start + size:start + size + n]
    return []


@torch.no_grad()
def generate_uncached(model, prompt: list[int], max_new_tokens: int, mode: DecodeConfig,
                      mask_id=None, stop_ids=()) -> tuple[list[int], list[int]]:
    """Every mode by definition, batch size 1, no cache: each pass runs the whole
    text + drafts + masks. Returns (new tokens, tokens kept per pass)."""
    if mask_id is None:
        mask_id = model.config.mask_token_id
    budget = min(max_new_tokens, model.config.max_seq_len - len(prompt))
    out = []
    chunks = []
    drafts = []
    # one for each place a pass reads (lossless: drafts, then masks)
    temperatures = slot_temperatures(model, 2 * mode.block)
    while len(out) < budget and not (out and out[-1] in stop_ids):
        drafts, tail = drafts_and_masks(mode, drafts, budget - len(out), mask_id, prompt + out)
        x = torch.tensor([prompt + out + tail], device=next(model.parameters()).device)

        # the predictions: at the last real token, then at each draft and mask
        logits = model(x)[0, len(prompt) + len(out) - 1:].float()   # (1 + len(tail), V)
        preds, confs = top1(logits, mask_id, temperatures=temperatures)
        new, _, drafts = accept(mode, preds, confs, drafts, stop_ids)

        out += new
        chunks.append(len(new))
    return out, chunks


# --- The same with a KV cache, for a batch of prompts ---
# The cache (model.KVCache) holds every token of a row but its `pending` ones:
# those the last pass accepted (at first, the prompt's last token), which the
# next pass feeds before its drafts and masks. A row's predictions start at its
# last pending token. After each pass the cache forgets the masks, the rejected
# drafts and the padding.

def feed(model, cache, inputs: list[list[int]]):
    """One cached pass: row b feeds inputs[b], right-padded -> logits (B, T, V).
    The padding is computed, but its slots come after the row's real tokens, so
    no real token attends to them, and the rollback after the pass frees them."""
    T = max(len(x) for x in inputs)
    # 0: any token does, no one reads its logits
    rows = [x + [0] * (T - len(x)) for x in inputs]
    tokens = torch.tensor(rows, device=cache.lengths.device)     # (B, T)
    return model(tokens, cache=cache).float()


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, mode: DecodeConfig,
             mask_id=None, stop_ids=()) -> list[tuple[list[int], list[int]]]:
    """generate_uncached for a batch of prompts with a KV cache: the same (new
    tokens, tokens kept per pass) for each prompt."""
    if mask_id is None:
        mask_id = model.config.mask_token_id
    B = len(prompts)
    context = model.config.max_seq_len
    budgets = [min(max_new_tokens, context - len(p)) for p in prompts]
    # room for the longest row, and one pass of padding beyond it
    length = max(len(p) + n for p, n in zip(prompts, budgets)) + 2 * mode.block
    cache = model.new_cache(B, length)

    # 1) prefill: the cache takes every prompt but its last token
    all_but_last = [p[:-1] for p in prompts]
    if any(all_but_last):
        feed(model, cache, all_but_last)
        cache.rollback([len(x) for x in all_but_last])
    pending = [p[-1:] for p in prompts]
    drafts = [[] for _ in prompts]
    outs = [[] for _ in prompts]
    chunks = [[] for _ in prompts]
    done = [False] * B
    temperatures = slot_temperatures(model, 2 * mode.block)

    while not all(done):
        # 2) each row feeds its pending tokens, then drafts and masks
        inputs = []
        for b in range(B):
            if done[b]:
                # a finished row feeds only padding
                inputs.append([])
                continue
            wanted = budgets[b] - len(outs[b])
            drafts[b], tail = drafts_and_masks(mode, drafts[b], wanted, mask_id,
                                               prompts[b] + outs[b])
            inputs.append(pending[b] + tail)
        logits = feed(model, cache, inputs)                       # (B, T, V)

        # 3) each row's predictions, from its last pending token on, and its rule
        for b in range(B):
            if done[b]:
                continue
            first = len(pending[b]) - 1
            preds, confs = top1(logits[b, first:len(inputs[b])], mask_id, temperatures=temperatures)
            new, n_verified, drafts[b] = accept(mode, preds, confs, drafts[b], stop_ids)
            outs[b] += new
            chunks[b].append(len(new))
            # verified drafts were fed as themselves: their keys and values stay
            pending[b] = new[n_verified:]
            done[b] = new[-1] in stop_ids or len(outs[b]) >= budgets[b]

        # 4) the cache forgets the masks, the rejected drafts and the padding
        cached = [len(p) + len(o) - len(q) for p, o, q in zip(prompts, outs, pending)]
        cache.rollback(cached)
    return list(zip(outs, chunks))


# --- The command line: one prompt, decoded and shown ---

def parser() -> Parser:
    p = Parser(prog="confadapt.py",
               description="Multi-token decoding of an MTP model with a KV cache.")
    add_model_args(p)

    d = p.add_argument_group("decoding (default: ConfAdapt tau=0.9, k_max=16)")
    d.add_argument("--prompt", required=True, help="the text to continue")
    d.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="most tokens to generate")
    d.add_argument("--tau", type=probability,
                   help="ConfAdapt confidence threshold in (0, 1] (default 0.9)")
    d.add_argument("--k-max", type=positive_int,
                   help="ConfAdapt / lossless: most tokens per pass (default: the "
                   "folder's trained k_max, else 16)")
    one = d.add_mutually_exclusive_group()
    one.add_argument("--static-k", type=positive_int,
                     help="static k: keep all k predictions of every pass")
    one.add_argument("--lossless", action="store_true",
                     help="verify mask drafts: output == plain greedy")
    one.add_argument("--greedy", action="store_true",
                     help="plain greedy, one token per pass")
    d.add_argument("--lookup", action="store_true",
                   help="lossless: where the masks offer no drafts, copy them from "
                   "earlier in the text (prompt lookup)")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    o.add_argument("--png", default=None, help="also draw the chunks into this PNG file")
    o.add_argument("--color", default="auto", choices=["auto", "always", "never"],
                   help="colour the chunks")
    return p


def decode_config(args) -> DecodeConfig:
    """The decoding rule the flags ask for; a flag of another rule is an error."""
    kind = "confadapt"
    if args.greedy or args.static_k is not None:
        kind = "static"
    elif args.lossless:
        kind = "lossless"
    if kind != "confadapt" and args.tau is not None:
        raise CliError("--tau applies to ConfAdapt only "
                       "(not with --static-k, --lossless or --greedy)")
    if kind == "static" and args.k_max is not None:
        raise CliError("--k-max applies to ConfAdapt and --lossless only")
    if args.lookup and kind != "lossless":
        raise CliError("--lookup applies to --lossless only")
    # both are positive when given: `or` only fills in the defaults
    k_max = args.k_max or 16
    k = 1 if args.greedy else args.static_k or k_max
    return DecodeConfig(kind, k=k, tau=args.tau or 0.9, k_max=k_max, lookup=args.lookup)


def summary(s, gen) -> str:
    """The figures printed under the text: s, the engine's DecodeStats, and gen, its
    Generation of the prompt."""
    return (f"mode            {s.mode}{exactness(s.mode)}\n"
            f"tokens          {s.tokens}\n"
            f"forward passes  {s.forward_passes} (the prefill not counted)\n"
            f"effective k     {s.effective_k:.2f} tokens/pass\n"
            f"positions fed   {s.fed_tokens} ({s.fed_tokens / max(1, s.tokens):.2f} per token)\n"
            f"accepted/pass   {' '.join(f'{n}:{c}' for n, c in s.accept_hist.items())}\n"
            f"wall time       {s.seconds:.3f} s (prefill {s.prefill_seconds:.3f} s)\n"
            f"tokens/second   {s.tokens_per_second:.1f} (decoding)\n"
            f"chunk ends      {gen.boundaries}")


def generate_main(argv):
    # the engine builds on this file's rules: imported here, there is no cycle
    from mtp import engine

    args = parser().parse_args(argv)
    # the flags, then the folder before any weights: an adapter's base, the
    # k_max and format it was trained with, the format against its tokenizer
    decode_config(args)
    check_model_folder(args, k_max_applies=not (args.greedy or args.static_k))
    if args.png:
        png_folder = os.path.dirname(args.png) or "."
        output_folder(png_folder, f"--png {args.png}: its folder")
    mode = decode_config(args)
    model, tokenizer, mask_id, stop_ids = load(args, mode)
    fmt = prompt_format(args.format, tokenizer, model)
    stop_ids = chat_stop_ids(stop_ids, tokenizer, fmt)
    prompt = encode_prompt(tokenizer, model, args.prompt, fmt, no_bos=args.no_bos)

    # an untimed warm-up: first calls are slow
    engine.generate(model, [prompt[-8:]], 2, mode=mode, mask_id=mask_id)
    [gen], s = engine.generate(model, [prompt], args.max_new_tokens, mode=mode,
                               mask_id=mask_id, stop_ids=stop_ids)
    texts = chunk_texts(tokenizer, gen.tokens, gen.chunk_sizes)

    if args.json:
        keys = ("mode forward_passes effective_k seconds prefill_seconds "
                "tokens_per_second accept_hist").split()
        print(json.dumps({"text": "".join(texts),
                          "tokens": gen.tokens,
                          "prompt_tokens": len(prompt),
                          **{key: getattr(s, key) for key in keys},
                          "chunk_sizes": gen.chunk_sizes,
                          "chunk_ends": gen.boundaries,
                          "chunks": texts,
                          "stopped": gen.stopped}))
    else:
        colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
        shown = render_chunks(args.prompt, texts, gen.chunk_sizes, colour=colour)
        print(shown, "", summary(s, gen), sep="\n")

    if not gen.stopped and len(gen.tokens) < args.max_new_tokens:
        print("note: stopped at the end of the model's context "
              f"({model.config.max_seq_len} tokens)", file=sys.stderr)
    if args.png:
        os.makedirs(png_folder, exist_ok=True)
        title = (f"{s.mode}: {s.tokens} tokens in {s.forward_passes} passes "
                 f"(effective k {s.effective_k:.2f})")
        save_chunks_png(args.png, args.prompt, texts, gen.chunk_sizes, title=title)


def main(argv=None) -> int:
    return run_cli(generate_main, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
