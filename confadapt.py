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
                      greedy output, in fewer passes.

The file reads in order: the rules and `generate_uncached`, their definition for
one prompt without a cache; then `generate`, the same output with a KV cache and
batching (tests/test_confadapt.py checks they agree); then showing the chunks,
and the command line. Effective k = tokens / passes is not a speed-up: a pass
reading 2k-1 tokens costs more than one reading 1 (benchmarks/bench_modes.py
measures both).

Run:
    python confadapt.py --model DIR --prompt "1 2 3" \\
        [--tau 0.9 --k-max 16 | --static-k 4 | --lossless]

References: MTP via Self-Distillation (arXiv 2602.06019);
lossless: blockwise parallel decoding (arXiv 1811.03115).
"""

import itertools
import json
import os
import sys
from dataclasses import dataclass

import torch

from mtp.cli import (CliError, Parser, add_model_args, chat_stop_ids, encode_prompt, load,
                 output_folder, positive_int, probability, prompt_format, run_cli)

MODES = ("greedy", "static", "confadapt", "lossless")


@dataclass
class DecodeConfig:
    """Which decoding rule to use and how many predictions one pass may make."""

    kind: str = "confadapt"   # one of MODES
    # static: tokens per pass; lossless: most per pass (1 + k-1 drafts)
    k: int = 4
    # confadapt: the confidence threshold, in (0, 1]
    tau: float = 0.9
    # confadapt: most tokens per pass
    k_max: int = 16

    @property
    def block(self) -> int:
        """Predictions per pass: at the last real token, then at the masks."""
        return {
            "greedy": 1,
            "static": self.k,
            "confadapt": self.k_max,
            "lossless": self.k
        }[self.kind]

    def validate(self):
        if self.kind not in MODES:
            raise ValueError(f"unknown decoding mode {self.kind!r}; "
                             f"choose one of {', '.join(MODES)}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"threshold tau must be in (0, 1], got {self.tau}")
        if self.k < 1 or self.k_max < 1:
            raise ValueError(f"k must be at least 1, got k={self.k}, k_max={self.k_max}")

    def describe(self) -> str:
        return {
            "greedy": "greedy",
            "static": f"static k={self.k}",
            "lossless": f"lossless k={self.k}",
            "confadapt": f"confadapt tau={self.tau:g} k_max={self.k_max}"
        }[self.kind]


def decode_modes(static_ks=(), taus=(), k_max=16, lossless_k=None):
    """A decoding sweep -> DecodeConfigs: static k per k (k=1 is greedy), ConfAdapt
    per tau, lossless."""
    modes = [DecodeConfig("greedy") if k == 1 else DecodeConfig("static", k=k)
             for k in static_ks]
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


def accept(mode: DecodeConfig, preds: list[int], confs: list[float] | None,
           drafts: list[int], stop_ids):
    """One pass's accept rule -> (accepted tokens, how many of them were fed as
    drafts, next drafts). preds/confs: the argmax and its probability at the last
    real token, then at each draft and mask."""
    # The accept rules:
    #   greedy, static k: keep every prediction.
    #   ConfAdapt: keep the leading run with confidence >= tau, at least one.
    #   lossless: keep the `verified` drafts plus preds[verified], the model's own
    #   token after them: each is the argmax given greedy's text, so greedy's token.
    #   The mask predictions become the next drafts only if every draft held.
    # In every mode a stop token ends the chunk, and is kept.
    tokens = preds
    verified = 0
    next_drafts = []
    if mode.kind == "confadapt":
        tokens = preds[: accept_confadapt(confs, mode.tau)]
    elif mode.kind == "lossless":
        verified = verify_drafts(drafts, preds[: len(drafts)])
        tokens = preds[: verified + 1]
        if verified == len(drafts):
            next_drafts = preds[len(drafts) + 1:]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    return tokens, verified, next_drafts


def top1(mode, logits, mask_id=None):
    """The top prediction at each place (and its probability, for ConfAdapt).
    <mask> is an input, never an output: fed back, it would read as a mask slot."""
    if mask_id is not None:
        logits[..., mask_id] = float("-inf")
    if mode.kind != "confadapt":
        return logits.argmax(-1).tolist(), None
    confs, preds = logits.softmax(-1).max(-1)
    return preds.tolist(), confs.tolist()


def pass_tail(mode, drafts, wanted, mask_id):
    """(drafts, drafts + masks) to feed after the last real token: at most
    `wanted` predictions."""
    drafts = drafts[: wanted - 1]
    n_masks = min(mode.block - 1, wanted - 1 - len(drafts))
    return drafts, drafts + [mask_id] * n_masks


@torch.no_grad()
def generate_uncached(model, prompt: list[int], max_new_tokens: int, mode: DecodeConfig,
                      mask_id=None, stop_ids=()) -> tuple[list[int], list[int]]:
    """Every mode by definition, batch size 1, no cache: each pass runs the whole
    text + drafts + masks. Returns (new tokens, tokens kept per pass), as
    `generate` does."""
    if mask_id is None:
        mask_id = model.config.mask_token_id
    budget = min(max_new_tokens, model.config.max_seq_len - len(prompt))
    out = []
    chunks = []
    drafts = []
    while len(out) < budget and not (out and out[-1] in stop_ids):
        drafts, tail = pass_tail(mode, drafts, wanted=budget - len(out), mask_id=mask_id)
        x = torch.tensor([prompt + out + tail], device=next(model.parameters()).device)

        # the predictions: at the last real token, then at each draft and mask
        logits = model(x)[0, len(prompt) + len(out) - 1:].float()   # (1 + len(tail), V)
        preds, confs = top1(mode, logits, mask_id)
        new, _, drafts = accept(mode, preds, confs, drafts=drafts, stop_ids=stop_ids)

        out += new
        chunks.append(len(new))
    return out, chunks


# --- Showing the chunks (the paper's Figure 1): one colour run per forward pass ---

def chunk_texts(tokenizer, tokens, chunk_sizes) -> list[str]:
    """The text of each chunk, decoded as prefixes: a character split across
    chunks lands whole in the chunk that completes it."""
    texts = []
    done = ""
    for n, end in zip(chunk_sizes, itertools.accumulate(chunk_sizes)):
        full = tokenizer.decode(tokens[:end])
        if full.startswith(done):
            texts.append(full[len(done):])
        else:
            # the longer prefix decodes differently: the chunk's tokens alone
            texts.append(tokenizer.decode(tokens[end - n:end]))
        done = full
    return texts


# blue, orange
BACKGROUNDS = ("\x1b[30;48;5;153m", "\x1b[30;48;5;223m")
PNG_COLOURS = ("#b9d9f5", "#fbd8a8")


def render_chunks(prompt_text, texts, sizes, colour=True) -> str:
    """Prompt, then each chunk on an alternating background followed by its size
    as a dim subscript (the number of tokens that pass emitted). Without colour,
    chunks are bracketed."""
    out = [prompt_text]
    for i, (text, n) in enumerate(zip(texts, sizes)):
        sub = str(n).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))
        if not colour:
            out.append(f"[{text}]{sub}")
            continue
        # each line coloured on its own, so the background stops at line ends
        lines = [f"{BACKGROUNDS[i % 2]}{line}\x1b[0m" if line else ""
                 for line in text.split("\n")]
        body = "\n".join(lines)
        out.append(f"{body}\x1b[2m{sub}\x1b[0m")
    return "".join(out)


def wrap_cells(chars, width):
    """(char, chunk) pairs placed on a monospace grid `width` wide, wrapped at
    spaces -> cells (row, col, char, chunk), and the index of the last row."""
    cells = []
    row = 0
    col = 0
    wrapped = False
    for i, (ch, chunk) in enumerate(chars):
        # a word starting here: wrap before it unless it fits
        word = 0
        if ch not in " \n" and col > 0 and chars[i - 1][0] == " ":
            ends = (j for j in range(i, len(chars)) if chars[j][0] in " \n")
            word = next(ends, len(chars)) - i
        # a longer word than a line is cut
        if ch == "\n" or col >= width or col + word > width:
            row += 1
            col = 0
            wrapped = ch != "\n"
        # a wrapped line skips its leading spaces
        if ch != "\n" and not (ch == " " and col == 0 and wrapped):
            cells.append((row, col, ch, chunk))
            col += 1
    return cells, row


def save_chunks_png(path, prompt_text, texts, sizes, title="", width=80):
    """The same as a PNG: a monospace grid wrapped at spaces, each chunk's size
    above its start."""
    from matplotlib import figure, patches

    # chunk -1 is the prompt
    chars = [(ch, chunk) for chunk, text in [(-1, prompt_text)] + list(enumerate(texts))
             for ch in text.replace("\t", "    ")]
    cells, last_row = wrap_cells(chars, width)

    n_cols = max((c for _, c, _, _ in cells), default=0) + 1
    line_h = 1.6
    size = (n_cols * 0.11 + 0.4, (last_row + 1) * 0.26 + 0.6)
    ax = figure.Figure(figsize=size).subplots()
    for i, (r, c, ch, chunk) in enumerate(cells):
        y = -r * line_h
        if chunk >= 0:
            ax.add_patch(patches.Rectangle((c, y - 0.55), 1, 1.3,
                                           color=PNG_COLOURS[chunk % 2], lw=0))
        ax.text(c + 0.5, y, ch, ha="center", va="center", family="monospace", fontsize=9,
                parse_math=False, color="#666666" if chunk < 0 else "black")
        # a chunk's first character carries its size
        if chunk >= 0 and (i == 0 or cells[i - 1][3] != chunk):
            ax.text(c + 0.1, y + 0.75, str(sizes[chunk]), fontsize=4.5, color="#444444",
                    va="bottom")
    ax.set(xlim=(-0.5, n_cols + 0.5), ylim=(-last_row * line_h - 1.2, 1.4))
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")
    ax.figure.savefig(path, dpi=150, bbox_inches="tight")


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
                   help="ConfAdapt / lossless: most tokens per pass (default 16)")
    one = d.add_mutually_exclusive_group()
    one.add_argument("--static-k", type=positive_int,
                     help="static k: keep all k predictions of every pass")
    one.add_argument("--lossless", action="store_true",
                     help="verify mask drafts: output == plain greedy")
    one.add_argument("--greedy", action="store_true",
                     help="plain greedy, one token per pass")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    o.add_argument("--png", default=None, help="also draw the chunks into this PNG file")
    o.add_argument("--color", default="auto", choices=["auto", "always", "never"],
                   help="colour the chunks")
    return p


def decode_config(args) -> DecodeConfig:
    """The decoding rule the flags ask for; a flag of another rule is an error."""
    kind = "confadapt"
    if args.greedy:
        kind = "greedy"
    elif args.static_k is not None:
        kind = "static"
    elif args.lossless:
        kind = "lossless"
    if kind != "confadapt" and args.tau is not None:
        raise CliError("--tau applies to ConfAdapt only "
                       "(not with --static-k, --lossless or --greedy)")
    if kind in ("greedy", "static") and args.k_max is not None:
        raise CliError("--k-max applies to ConfAdapt and --lossless only")
    # both are positive when given: `or` only fills in the defaults
    k_max = args.k_max or 16
    return DecodeConfig(kind, k=args.static_k or k_max, tau=args.tau or 0.9, k_max=k_max)


def summary(s, gen) -> str:
    """The figures printed under the text: s, the engine's DecodeStats, and gen, its
    Generation of the prompt."""
    return (f"mode            {s.mode}\n"
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
    from mtp.engine import generate

    args = parser().parse_args(argv)
    if args.png:
        png_folder = os.path.dirname(args.png) or "."
        output_folder(png_folder, f"--png {args.png}: its folder")
    mode = decode_config(args)
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
