"""Benchmark: decoding a real model with our modes, side by side with what a user would pick instead.

On a real model (SmolLM2-135M-Instruct: about 0.5 GB of float32 weights read per pass) a forward
pass costs real work, so its speed-ups say what a user gains. In one run, on the same weights
and the same prompts in the model's chat format (--prompts chat: requests of four domains;
word_problems: held-out word problems, as finetune_hf.py eval's zero-shot prompts ask them),
these decoders take turns (bench_modes.bench):

    greedy                      ours: mtp.engine.generate, one token per pass
    transformers greedy         AutoModelForCausalLM.generate(do_sample=False) on the same folder
    transformers prompt lookup  generate(prompt_lookup_num_tokens=N): drafts copied from earlier
                                text and verified in one pass; lossless and training-free, what a
                                user without a draft model picks today (batch 1 only: transformers'
                                assisted generation takes one row)
    static k, ConfAdapt, lossless   ours, reading the tuned model's <mask> predictions
    lossless + lookup           ours, lossless with prompt lookup's drafts where the masks offer none

at batch sizes 1, 4 and 16 (transformers pads a static batch until its longest row ends; ours
gives a finished row's place to the next prompt). Then the forward-pass latency curve: one cached
pass of T = 1..32 new positions per row at batch 1 and 16 (on the CPU in float32 and bfloat16),
which is what turns fewer passes (effective k) into time saved, or not; for a gated mask adapter
folder each pass is 1 token + (T - 1) <mask>s, timed without and with the adapter in turns, and
its pass at the lossless k_max is priced against the one-token pass without it.

    python benchmarks/decode_real.py --model DIR --out DIR [--prompts word_problems] [--quick]
                                     [--device cuda]

writes results.json, results.md (the tables), samples.md (the answers at the smallest batch size,
every pass's tokens between | marks), decoding.png and latency.png to --out.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from adapter_pass import pass_times  # noqa: E402
from bench_modes import bench, forward_latency  # noqa: E402
from mtp.cli import (CUDNN_ATTENTION, CliError, Parser, add_calibration_flag, add_flags, apply_attention_backend,  # noqa: E402
                     base_folder, check_model_folder, cpu_name, exactness, load_model, parse_device,
                     parse_dtype, positive_int, provenance, stop_ids_of)
from confadapt import DecodeConfig, decode_modes  # noqa: E402
from mtp.chunks import chunk_texts  # noqa: E402
from mtp.engine import DecodeStats, Generation, generate, synchronize  # noqa: E402
from mtp.tokenizer import default_format, end_token, FORMATS, prompt_tokens
from tasks.word_problems import domain_prompts, word_problem_split
from adapter import is_adapter_folder  # noqa: E402
from model import add_mask_token  # noqa: E402
from mtp.hf import save_pretrained, write_text  # noqa: E402

HF_GREEDY, HF_LOOKUP = "transformers greedy", "transformers prompt lookup"
MODE_CHOICES = ("greedy", "hf-greedy", "hf-lookup", "static", "confadapt", "lossless", "lossless-lookup")

# ----------------------------------------------------------------------------------------------
# Prompts: four chat domains, each asking for an answer of a few paragraphs, or word problems
# ----------------------------------------------------------------------------------------------
# Generated here, so that no training file holds them; the word problems are the first questions
# of tasks/word_problems.py's test split (write_word_problems keeps them out of its training file).

CODE_TASKS = ["reverses the words of a sentence", "checks whether a number is prime", "counts the vowels in a text",
              "merges two sorted lists", "removes duplicates from a list but keeps the order",
              "returns the n-th Fibonacci number", "converts Celsius to Fahrenheit", "finds the second largest number"]
TOPICS = ["why the sky is blue", "how vaccines work", "what causes the seasons", "how a rainbow forms",
          "the water cycle", "how a bicycle stays upright", "how plants make food from sunlight", "what an atom is"]
CHARACTERS = ["a lighthouse keeper", "a young baker", "a robot gardener", "a retired pilot"]
EVENTS = ["finds an old map", "learns to play the violin", "makes an unexpected friend", "is caught in a snowstorm"]


def chat_prompts(per_domain: int) -> list[tuple[str, str]]:
    """(domain, request) pairs, the domains interleaved so that any leading slice covers all four."""
    problems = word_problem_split(20000, per_domain, seed=0)[1]
    domains = {
        "math": [f"{p.question} Solve it step by step." for p in problems],
        "code": [f"Write a Python function that {t}, and explain how it works." for t in CODE_TASKS],
        "explain": [f"Explain {t} to a curious twelve-year-old, in a few paragraphs." for t in TOPICS],
        "story": [f"Write a short story about {c} who {e}." for e in EVENTS for c in CHARACTERS],
    }
    return [(d, texts[i % len(texts)]) for i in range(per_domain) for d, texts in domains.items()]


def word_problem_prompts(n: int) -> list[tuple[str, str]]:
    """("word_problems", question) pairs: the first n questions of the held-out split that
    finetune_hf.py eval reads (write_word_problems' test.jsonl), asked bare, as its zero-shot
    prompts ask them."""
    return [("word_problems", q) for q in domain_prompts("word_problems", n, split="test")]


# --prompts: each set's (domain, request) pairs for --prompts-per-domain; the word problems are
# one domain, as many prompts as the chat set's four
PROMPT_SETS = {"chat": chat_prompts,
               "word_problems": lambda per_domain: word_problem_prompts(4 * per_domain)}


# ----------------------------------------------------------------------------------------------
# transformers' generate, measured like ours
# ----------------------------------------------------------------------------------------------

class PassLog:
    """What one `generate` call did, seen from outside: a streamer notes when each pass's tokens
    arrive (generate hands it the prompt first, then every pass's new tokens), and a forward
    pre-hook counts the positions each pass computes."""

    def __init__(self):
        self.arrivals, self.positions = [], []

    def put(self, tokens):                         # the streamer interface: called with CPU tensors
        self.arrivals.append((time.perf_counter(), tokens.shape[-1] if tokens.dim() > 1 else 1))

    def end(self):
        pass

    def hook(self, module, args, kwargs):
        self.positions.append(kwargs["input_ids"].numel())


@torch.inference_mode()
def hf_decode(hf, rows: list[list[int]], max_new_tokens: int, batch_size: int, stop_ids: set, lookup: int | None):
    """Decode `rows` batch_size at a time with transformers' generate; (Generations, DecodeStats)
    measured as mtp.engine.generate measures itself, or None where generate cannot (lookup, batch > 1).

    A static batch is left-padded (with an attention mask) and decoded until its longest row ends;
    finished rows keep being computed, which the positions fed show. The prefill pass computes the
    prompt and makes each row's first token (ours feeds the prompt's last token in its first
    decoding pass), so decoding time starts when the prefill's tokens arrive and counts the
    tokens made after them, per row the same passes as ours.
    """
    if lookup and batch_size > 1:
        return None
    device, pad = hf.device, min(stop_ids)          # padding is masked out; any id would do
    gens, tokens = [], 0
    seconds = prefill = passes = row_passes = fed = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        T = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (T - len(p)) + p for p in chunk], device=device)               # (B, T)
        attention = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in chunk], device=device)
        log = PassLog()
        handle = hf.register_forward_pre_hook(log.hook, with_kwargs=True)
        try:
            synchronize(device)
            t0 = time.perf_counter()
            out = hf.generate(ids, attention_mask=attention, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=sorted(stop_ids), pad_token_id=pad, prompt_lookup_num_tokens=lookup,
                              streamer=log)
            synchronize(device)
            t1 = time.perf_counter()
        finally:
            handle.remove()
        (t_prefilled, first_tokens), later = log.arrivals[1], log.arrivals[2:]     # arrivals[0]: the prompt
        for row in out[:, T:].tolist():
            stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
            row = row if stop is None else row[:stop + 1]                  # cut after the first stop token
            gens.append(Generation(row, [], stopped=stop is not None))    # passes per row: not observed
            tokens += max(0, len(row) - first_tokens)                      # the prefill pass's tokens don't count
        seconds += t1 - t0
        prefill += t_prefilled - t0
        passes += len(later)
        row_passes += len(later) if lookup else sum(len(g.tokens) - 1 for g in gens[-len(chunk):])
        fed += sum(log.positions[1:])
    stats = DecodeStats(mode=HF_LOOKUP if lookup else HF_GREEDY, batch_size=batch_size, forward_passes=passes,
                        row_passes=row_passes, tokens=tokens, effective_k=tokens / max(1, row_passes),
                        fed_tokens=fed, accept_hist={}, seconds=seconds, prefill_seconds=prefill,
                        tokens_per_second=tokens / max(seconds - prefill, 1e-9))
    return gens, stats


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def load(args, device, dtype, need_mask: bool):
    """Our model, tokenizer, mask id and transformers' copy of the same weights.

    A model without <mask> (not MTP-tuned) gets an untrained one, so that every mode runs; its
    mask predictions are rarely accepted, which is fine for checking the benchmark. transformers
    then loads our weights, written to a temporary folder, so both sides decode the same matrices.
    A gated mask adapter's folder: ours is base + adapter, transformers' the untuned base (which
    is what our greedy and lossless modes print then).
    """
    ours, tok, _, _ = load_model(args.model, device, dtype, args.base, not args.no_calibration)
    if ours.config.mask_token_id is None and tok.mask_id is not None:
        ours.config.mask_token_id = tok.mask_id
    grown = need_mask and ours.config.mask_token_id is None
    if grown:
        print(f"note: {args.model} has no <mask> token; adding an untrained one (the MTP modes then accept few "
              f"predictions: for checking the benchmark, not for its figures)", file=sys.stderr)
        add_mask_token(ours, tok)
    hf = None
    if {"hf-greedy", "hf-lookup"} & set(args.modes) and "decoding" in args.parts:
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            if grown:
                save_pretrained(ours, tmp)
            folder = tmp if grown else base_folder(args.model, args.base)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return ours, tok, hf


def run(args) -> dict:
    device = parse_device(args.device)
    apply_attention_backend(args.cudnn_attention, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    check_model_folder(args, raw=False)                # before any weights; may set k_max, format
    if not isinstance(args.k_max, list):
        args.k_max = [args.k_max or 16]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = decode_modes(dict.fromkeys([1] + [args.static_k] * ("static" in args.modes)))    # k = 1: greedy
    if "confadapt" in args.modes:                      # every threshold at every k_max
        modes += [m for k in args.k_max for m in decode_modes(taus=args.taus, k_max=k)]
    if "lossless" in args.modes:
        modes += decode_modes(lossless_k=args.lossless_k or max(args.k_max))
    if "lossless-lookup" in args.modes:                # drafts from the text where masks offer none
        modes.append(DecodeConfig("lossless", k=args.lossless_k or max(args.k_max), lookup=True))
    dtype = parse_dtype(args.dtype, device)
    ours, tok, hf = load(args, device, dtype, need_mask=any(m.block > 1 for m in modes))
    fmt = args.format if args.format != "auto" else default_format(tok, ours.config.model_type)
    stop_ids = stop_ids_of(ours, tok) | {end_token(tok, fmt)}    # the format's end of turn too
    requests = PROMPT_SETS[args.prompts](args.prompts_per_domain)
    prompts = [prompt_tokens(tok, fmt, text) for _, text in requests]
    dtype_name = str(dtype).removeprefix("torch.")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    meta = {"model": args.model, "reference": args.reference, "machine": machine, "device": str(device),
            **provenance(dtype, device), "prompts": args.prompts, "format": fmt,
            "k_max": args.k_max,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "requests": requests,
            "rows": args.rows or max(len(prompts), max(args.batch_sizes)),     # bench_modes.bench's workload
            "prompt_tokens": [len(p) for p in prompts]}
    report = {"meta": meta, "decoding": [], "latency_ms": {}}

    if "decoding" in args.parts:
        others = {}
        if "hf-greedy" in args.modes:
            others[HF_GREEDY] = lambda r, n, bs: hf_decode(hf, r, n, bs, stop_ids, None)
        if "hf-lookup" in args.modes:
            others[f"{HF_LOOKUP} n={args.lookup_tokens}"] = \
                lambda r, n, bs: hf_decode(hf, r, n, bs, stop_ids, args.lookup_tokens)
        print(f"decoding {meta['rows']} rows of up to {args.max_new_tokens} tokens with {len(modes) + len(others)} "
              f"decoders at batch sizes {args.batch_sizes}, {args.repeats} round(s)", file=sys.stderr, flush=True)
        outputs = {}                                       # (batch size, mode) -> the Generations
        result = bench(ours, prompts, args.max_new_tokens, modes, args.batch_sizes, ours.config.mask_token_id,
                       stop_ids, args.repeats, latency_sizes=(), n_rows=meta["rows"], others=others,
                       outputs=outputs)["results"]
        domains = [requests[i % len(requests)][0] for i in range(meta["rows"])]     # bench cycles the prompts
        for r in result:                    # tokens per pass by domain, where the passes are known (ours)
            gens = outputs[r["batch_size"], r["mode"]]
            if all(g.chunk_sizes for g in gens):
                r["effective_k_by_domain"] = {
                    d: sum(len(g.tokens) for g, x in zip(gens, domains) if x == d)
                    / sum(g.forward_passes for g, x in zip(gens, domains) if x == d) for d in dict.fromkeys(domains)}
        if args.reference:
            same_as_reference(result, outputs, prompts, meta["rows"], stop_ids, args, device, dtype)
        write_samples(out / "samples.md", tok, requests, outputs, min(args.batch_sizes))
        theirs = {r["batch_size"]: r["tokens_per_second"] for r in result if r["kind"] == HF_GREEDY}
        for r in result:
            base = theirs.get(r["batch_size"])
            r["speedup_vs_transformers"] = r["tokens_per_second"] / base if base else None
        report["decoding"] = result
        if hf is not None:
            import transformers
            meta["transformers"] = transformers.__version__
        del hf                                     # transformers' copy is not needed for the latency curve
        save(report, out)                  # a later part that fails loses nothing of this one

    if "latency" in args.parts:
        context = round(sum(meta["prompt_tokens"]) / len(prompts)) + args.max_new_tokens // 2
        meta["latency_context"] = context
        # A gated adapter's pass is 1 token + (T - 1) <mask>s: timed with the adapter on and off,
        # and at the lossless k_max (the pass whose cost against the one-token one decides).
        adapter_k = (args.lossless_k or max(args.k_max)) if is_adapter_folder(args.model) else None
        sizes = args.latency_sizes
        if adapter_k:
            sizes = sorted({*sizes, 1, adapter_k})
            meta["adapter_k_max"] = adapter_k
            report["adapter_latency_ms"] = {}
        # Both dtypes on the CPU (their costs differ by CPU); on a GPU the decoding dtype alone.
        for name in args.latency_dtypes or (["float32", "bfloat16"] if device.type == "cpu" else [dtype_name]):
            model = ours
            if name != dtype_name:
                model = load_model(args.model, device, getattr(torch, name), args.base,
                                   not args.no_calibration)[0]
            repeats = args.latency_repeats
            curves = {bs: adapter_latency(model, bs, context, sizes, repeats) if adapter_k
                      else (forward_latency(model, bs, context, sizes, repeats), None)
                      for bs in args.latency_batch_sizes}
            report["latency_ms"][name] = {bs: {T: s * 1e3 for T, s in off.items()}
                                          for bs, (off, _) in curves.items()}
            if adapter_k:
                report["adapter_latency_ms"][name] = {bs: {T: s * 1e3 for T, s in on.items()}
                                                      for bs, (_, on) in curves.items()}
            print(f"latency curve {name} done", file=sys.stderr, flush=True)
            save(report, out)
    return report


def adapter_latency(model, batch_size: int, context: int, sizes, repeats: int):
    """Median seconds ({T: s} without the adapter, {T: s} with it) of one cached pass of 1 token
    and T - 1 <mask>s per row over `context` cached tokens, the passes taking turns."""
    shapes = {(T, on): (1, T - 1, on) for T in sizes for on in (False, True)}
    times = pass_times(model, context, shapes, repeats, batch_size)
    return tuple({T: statistics.median(times[T, on]) for T in sizes} for on in (False, True))


def same_as_reference(result, outputs, prompts, n_rows, stop_ids, args, device, dtype):
    """Each decoder's share of answers identical to the greedy answers of another model folder
    (--reference: the untuned model, say), decoded at the same batch size: r["same_as_reference"]."""
    model = load_model(args.reference, device, dtype)[0]
    rows = [prompts[i % len(prompts)] for i in range(n_rows)]
    theirs = {bs: generate(model, rows, args.max_new_tokens, DecodeConfig("static", k=1), stop_ids=stop_ids,
                           batch_size=bs)[0] for bs in args.batch_sizes}
    for r in result:
        gens, ref = outputs[r["batch_size"], r["mode"]], theirs[r["batch_size"]]
        r["same_as_reference"] = sum(g.tokens == x.tokens for g, x in zip(gens, ref)) / len(ref)


def save(report: dict, out: Path):
    """results.json, results.md and the plots of what has been measured so far."""
    write_text(out / "results.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "results.md", markdown(report))
    if report["decoding"]:
        plot_decoding(report, out / "decoding.png")
    if report["latency_ms"]:
        plot_latency(report, out / "latency.png")


# ----------------------------------------------------------------------------------------------
# Tables and plots
# ----------------------------------------------------------------------------------------------

LOSSLESS_KINDS = ("lossless", HF_GREEDY)            # and prompt lookup: modes that promise greedy's output


def write_samples(path, tok, requests, outputs, batch_size):
    """Each prompt's answers at one batch size, every pass's tokens between | marks where known."""
    lines = []
    for i, (domain, text) in enumerate(requests):
        lines += [f"## {domain}: {text}", ""]
        for (bs, mode), gens in outputs.items():
            if bs == batch_size:
                g = gens[i]
                sizes = g.chunk_sizes if max(g.chunk_sizes, default=1) > 1 else [len(g.tokens)]   # greedy: one piece
                passes = f", {g.forward_passes} passes" if g.chunk_sizes else ""
                lines += [f"**{mode}** ({len(g.tokens)} tokens{passes}):", "",
                          "    " + "|".join(chunk_texts(tok, g.tokens, sizes)).replace("\n", "\n    "), ""]
    write_text(path, "\n".join(lines))


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"### Decoding {m['model']} on {m['machine']} ({m['device']}, {m['dtype']}, "
             f"{m['threads']} threads), {m['prompts'].replace('_', '-')} prompts", ""]
    if report["decoding"]:
        rows = report["decoding"]
        reference = m.get("reference")
        lines += ["| batch | mode | tokens/s | vs our greedy | vs transformers greedy | effective k | efficiency "
                  "| fed/token | output = greedy |" + (" = reference's greedy |" if reference else ""),
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if reference else "")]
        for r in rows:
            vs_hf = f"{r['speedup_vs_transformers']:.2f}x" if r["speedup_vs_transformers"] else ""
            promises_greedy = r["kind"] in LOSSLESS_KINDS or r["kind"].startswith(HF_LOOKUP)
            same = ("yes" if r["equals_greedy"] else "**no**") if promises_greedy else ""
            mode = r["mode"] + exactness(r["mode"])
            lines.append(f"| {r['batch_size']} | {mode} | {r['tokens_per_second']:,.1f} | {r['speedup']:.2f}x "
                         f"| {vs_hf} | {r['effective_k']:.2f} | {r['efficiency']:.2f} | {r['fed_per_token']:.2f} "
                         f"| {same} |" + (f" {r['same_as_reference']:.0%} |" if "same_as_reference" in r else ""))
        lookup = any(r["kind"].startswith(HF_LOOKUP) for r in rows)
        prompts = m["prompts"].replace("_", "-")
        lines += ["", f"{len(m['requests'])} {prompts} prompts ({m['format']} format, "
                      f"{min(m['prompt_tokens'])}-"
                      f"{max(m['prompt_tokens'])} tokens) cycled to {m['rows']} rows, "
                      f"at most {m['max_new_tokens']} new tokens each; modes take turns, best of {m['repeats']}. "
                      "tokens/s: tokens per second of decoding (prefill excluded); effective k: tokens per forward "
                      "pass of a row; efficiency: speed-up over our greedy / effective k; fed/token: positions the "
                      "decoding passes computed per token."
                  + (" transformers' prompt lookup runs at batch 1 only (its assisted generation takes one row)."
                     if lookup else ""), ""]
        by_domain = [r for r in rows if r["batch_size"] == rows[0]["batch_size"] and "effective_k_by_domain" in r]
        if by_domain:
            names = list(by_domain[0]["effective_k_by_domain"])
            lines += [f"| tokens per pass, batch {rows[0]['batch_size']} | " + " | ".join(names) + " |",
                      "|---|" + "---|" * len(names)]
            lines += [f"| {r['mode']} | " + " | ".join(f"{r['effective_k_by_domain'][d]:.2f}" for d in names) + " |"
                      for r in by_domain] + [""]
    if report["latency_ms"]:
        sizes = sorted({T for curves in report["latency_ms"].values() for c in curves.values() for T in c})
        shown = [T for T in sizes if T in (1, 2, 4, 8, 16, 32) or T == sizes[-1]]
        lines += ["| batch | dtype | " + " | ".join(f"T = {T}" for T in shown) + " |",
                  "|---|---|" + "---|" * len(shown)]
        adapter = report.get("adapter_latency_ms", {})
        for name, curves in report["latency_ms"].items():
            for bs, c in curves.items():
                cells = [f"{c[T]:.1f}" if T == shown[0] else f"{c[T]:.1f} ({c[T] / c[shown[0]]:.2f}x)" for T in shown]
                lines.append(f"| {bs} | {name} | " + " | ".join(cells) + " |")
                if name in adapter:
                    on = adapter[name][bs]
                    cells = [f"{on[T]:.1f} ({on[T] / c[shown[0]]:.2f}x)" for T in shown]
                    lines.append(f"| {bs} | {name}, adapter on | " + " | ".join(cells) + " |")
        lines += ["", f"Milliseconds of one cached forward pass of T new positions per row, on top of "
                      f"{m['latency_context']} cached tokens (ratio to T = {shown[0]})."
                  + (" A gated mask adapter's pass is 1 token + (T - 1) <mask>s, without and "
                     "with the adapter (its ratios to the one-token pass without it)."
                     if adapter else ""), ""]
        k = m.get("adapter_k_max")
        for name, curves in adapter.items():
            for bs, on in curves.items():
                ratio = on[k] / report["latency_ms"][name][bs][1]
                lines.append(f"Batch {bs}, {name}: the adapter's pass of 1 token + {k - 1} masks "
                             f"costs {ratio:.2f}x the one-token pass without the adapter.")
        lines += [""] * bool(adapter)
    return "\n".join(lines)


def plot_decoding(report: dict, path):
    """Tokens/s against batch size, one line per mode."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    for mode in dict.fromkeys(r["mode"] for r in report["decoding"]):
        pts = [(r["batch_size"], r["tokens_per_second"]) for r in report["decoding"] if r["mode"] == mode]
        ax.plot(*zip(*pts), marker="o", label=mode, linestyle="--" if mode.startswith("transformers") else "-")
    sizes = sorted({r["batch_size"] for r in report["decoding"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (decoding)")
    m = report["meta"]
    ax.set_title(f"{Path(m['model']).name}, {m['device']} {m['dtype']}: {m['machine']}", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def plot_latency(report: dict, path):
    """Milliseconds per cached pass against new positions per row, one panel per batch size."""
    from matplotlib.figure import Figure

    batch_sizes = sorted({bs for curves in report["latency_ms"].values() for bs in curves})
    fig = Figure(figsize=(4.2 * len(batch_sizes), 3.8))
    for i, bs in enumerate(batch_sizes):
        ax = fig.add_subplot(1, len(batch_sizes), i + 1)
        for name, curves in report["latency_ms"].items():
            if bs in curves:
                ax.plot(list(curves[bs]), list(curves[bs].values()), marker=".", label=name)
        for name, curves in report.get("adapter_latency_ms", {}).items():
            if bs in curves:
                ax.plot(list(curves[bs]), list(curves[bs].values()), marker=".", linestyle="--",
                        label=f"{name}, adapter on")
        ax.set_xlabel("new positions per row (T)")
        ax.set_ylabel("ms per forward pass")
        ax.set_ylim(bottom=0)
        ax.set_title(f"batch {bs}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = report["meta"]
    fig.suptitle(f"{Path(m['model']).name} on {m['machine']}, {m['latency_context']} cached tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

QUICK = {"prompts_per_domain": 1, "max_new_tokens": 48, "batch_sizes": [1, 4], "repeats": 1,
         "latency_sizes": [1, 2, 4, 8, 16, 32], "latency_repeats": 2}
FULL = {"prompts_per_domain": 4, "max_new_tokens": 128, "batch_sizes": [1, 4, 16], "repeats": 2,
        "latency_sizes": list(range(1, 33)), "latency_repeats": 5}


def parse(argv):
    p = Parser(prog="decode_real.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and machine")
    g.add_argument("--model", required=True, help="Hugging Face layout folder (the MTP-tuned model for real figures)")
    g.add_argument("--base", help="a gated mask adapter's base model folder, if not where its mask_adapter.json says")
    g.add_argument("--out", required=True, help="folder for results.json/.md, samples.md, decoding.png, latency.png")
    g.add_argument("--device", default="auto", help="auto (the default: cuda if available), cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype of the decoding runs; auto (the default): bfloat16 where the hardware "
                   "computes it natively (a GPU from Ampere on, a CPU with AVX-512 BF16 or AMX), else float32")
    add_flags(g,
              ("--threads", positive_int, None, "CPU threads for torch (default: torch's choice)"),
              CUDNN_ATTENTION,
              ("--format", None, "auto",
               "prompt format (auto: the folder's trained format, else the one finetune_hf.py picks for this "
               "tokenizer)",
               {"choices": ("auto",) + FORMATS}))
    add_calibration_flag(g)
    r = p.add_argument_group("workload (--quick: 4 prompts, 48 tokens, batch 1 and 4, one round, latency at 6 sizes)")
    r.add_argument("--quick", action="store_true", help="a smoke run in minutes, for checking the command")
    add_flags(r,
              ("--prompts", None, "chat", "chat (the default): requests of four domains (math, "
               "code, explain, story); word_problems: held-out word problems, one domain, as "
               "many prompts",
               {"choices": tuple(PROMPT_SETS)}),
              ("--parts", None, ["decoding", "latency"], None,
               {"nargs": "+", "choices": ["decoding", "latency"]}),
              ("--prompts-per-domain", int, None,
               f"prompts of each of 4 domains (default {FULL['prompts_per_domain']})"),
              ("--max-new-tokens", int, None, f"default {FULL['max_new_tokens']}"),
              ("--batch-sizes", int, None, f"default {FULL['batch_sizes']}", {"nargs": "+"}),
              ("--rows", int, None, "the prompts cycled to this many rows (default: as many as the prompts "
               "or the largest batch size; more keep a batch full: a finished row's place goes to a waiting one)"),
              ("--repeats", int, None,
               f"rounds over all modes, each keeps its fastest (default {FULL['repeats']})"))
    d = p.add_argument_group("decoding modes")
    add_flags(d,
              ("--modes", None, list(MODE_CHOICES), "which to run (our greedy, the reference, always runs)",
               {"nargs": "+", "choices": MODE_CHOICES}),
              ("--static-k", int, 4, None),
              ("--taus", float, [0.9, 0.7], "ConfAdapt thresholds", {"nargs": "+"}),
              ("--k-max", int, None, "ConfAdapt: most tokens per pass (several: each with every tau; default: "
               "the folder's trained k_max, else 16)", {"nargs": "+"}),
              ("--lossless-k", int, None, "lossless: most tokens per pass (default: the largest --k-max)"),
              ("--lookup-tokens", int, 10, "transformers' prompt_lookup_num_tokens"),
              ("--reference", None, None, "another model folder (the untuned model, say): report each "
               "decoder's share of answers identical to its greedy answers at the same batch size"))
    la = p.add_argument_group("latency curve")
    add_flags(la,
              ("--latency-sizes", int, None, "new positions per row (default 1..32)", {"nargs": "+"}),
              ("--latency-batch-sizes", int, [1, 16], None, {"nargs": "+"}),
              ("--latency-dtypes", None, None,
               "default: float32 and bfloat16 on the CPU, the decoding dtype on a GPU",
               {"nargs": "+", "choices": ["float32", "bfloat16"]}),
              ("--latency-repeats", int, None,
               f"timed passes per point, median (default {FULL['latency_repeats']})"))
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # Each at least 1 (every value of a list); --rows unset and --lossless-k unset or 0 (the
    # largest --k-max) are not numbers to check.
    for name in ("prompts_per_domain", "max_new_tokens", "batch_sizes", "rows", "repeats", "static_k",
                 "k_max", "lossless_k", "lookup_tokens", "latency_sizes", "latency_batch_sizes",
                 "latency_repeats"):
        value = getattr(args, name)
        lowest = min(value) if isinstance(value, list) else value
        if lowest is not None and lowest < 1 and (name, lowest) != ("lossless_k", 0):
            raise CliError(f"--{name.replace('_', '-')} must be at least 1, got {lowest}")
    if args.rows is not None and args.rows < 4 * args.prompts_per_domain:
        raise CliError(f"--rows {args.rows}: fewer than the {4 * args.prompts_per_domain} prompts (4 domains x "
                       f"--prompts-per-domain {args.prompts_per_domain})")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise CliError(f"--out {args.out} is a file, not a folder")
    return args


def main(argv=None) -> int:
    try:
        report = run(parse(sys.argv[1:] if argv is None else list(argv)))
    except (CliError, ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        print(f"decode_real.py: error: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
