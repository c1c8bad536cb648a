"""Fine-tune a Hugging Face Llama/Qwen/SmolLM2 checkpoint into a multi-token predictor; measure it.

`train`: add <mask> and self-distill against a frozen copy (data.mtp_layout +
distill.mtp_loss), on one process or FSDP2-sharded under torchrun, then export a
Hugging Face folder. `eval`: GSM8K scored as lm-evaluation-harness's gsm8k_cot,
over static k and ConfAdapt thresholds. `analyze`: before tuning, what ConfAdapt
could reach on a domain. `data`: own answers as rows. `export`: a checkpoint ->
a folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp.cli import (CliError, Parser, Progress, base_folder, count, fields_of,
                 format_seconds, input_path, load_model, load_tokenizer,
                 native_bfloat16_gpu, number, output_folder, parse_device,
                 positive_float, positive_int, probability, provenance,
                 read_checkpoint, read_rows, run_cli, stop_ids_of)
from confadapt import DecodeConfig, accept_confadapt, decode_modes
from data import (DOMAINS, FORMATS, PROMPTS, Tokenizer, default_format,
                  default_n_regions, domain_prompts, end_token, mtp_layout,
                  padding_token, prompt_tokens, sample_k_and_offset, start_tokens,
                  training_sequences)
from adapter import ADAPTER_TARGETS, add_mask_adapter, gated_mtp_loss, save_mask_adapter
from distill import LOSSES, frozen_teacher, mtp_loss, training_state_bytes
from model import Transformer, add_mask_token
from mtp.engine import generate
from mtp.hf import (atomic_save, from_pretrained, read_json, read_model_config,
                    save_pretrained, write_json)


# === train: student + frozen teacher -> data rows -> AdamW -> loop -> export ===
# A step's --batch-size rows are split over the processes and, in each, into
# --micro-batch rows (gradient accumulation). All processes draw the same k and
# offset, seeded by the step number, from a seeded data order per epoch: a step
# is a function of its number, so a resumed run is bit-exact.
def train(args) -> Path:
    dist = setup_processes(args.device, args.dtype)

    # 1. The student (with <mask>) and a frozen copy of it as teacher (gt: none;
    # the gated adapter: none, gated_mtp_loss switches the adapter off instead).
    student, teacher, tok, mask_id = load_student_and_teacher(
        args, dist, with_teacher=args.mode != "gt")

    # 2. Data: (prompt, response) rows in the model's format, cut and padded.
    if args.format == "auto":
        args.format = default_format(tok, student.config.model_type)
    pad = padding_token(tok, args.format)
    args.regions = args.regions or default_n_regions(args.seq_len, args.k_max)
    pairs = training_pairs(args, dist)
    # (rows, seq_len) each; `trained` marks the response, the only targets with
    # --response-only (without it every token is trained: None).
    seqs, response = training_sequences(pairs, tok, args.format, args.seq_len)
    trained = response if args.response_only else None
    check_targets(seqs, trained, tok, args, dist)

    # Recompute each block's activations in backward (same parameter names).
    if args.activation_checkpointing:
        from torch.distributed._composable import checkpoint
        for block in student.layers:
            checkpoint(block)

    # 3. AdamW (no decay on the norms); the rate warms up, holds, then falls to
    # 0 over the last --decay steps.
    def lr_scale(step):
        return min(1.0, (step + 1) / max(1, args.warmup),
                   (args.steps - step) / max(1, args.decay))

    optimizer = student.configure_optimizer(
        args.lr, args.weight_decay, (args.beta1, args.beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)

    # --overwrite, or --resume from the last checkpoint: the step to start at.
    start = start_or_resume(student, optimizer, scheduler, args, dist)
    out = Path(args.out)

    micro_batches = args.batch_size // dist.world // args.micro_batch
    state = training_state_bytes(
        student, dist.dtype, teacher_copy=teacher is not None)
    parts = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in state.items())
    dist.log(f"training state: {sum(state.values()) / 2**30:.2f} GB over {dist.world} "
             f"process(es) ({parts})")
    dist.log(f"{args.mode} training: {len(pairs):,} rows, format {args.format}, "
             f"{args.steps:,} steps of {args.batch_size} sequences of {args.seq_len} "
             f"tokens, {dist.world} process(es) on {dist.device}, {micro_batches} "
             f"micro-batch(es) of {args.micro_batch} each")

    sequences = args.steps * args.batch_size
    if dist.device.type == "cpu" and sequences >= 1_000_000:
        dist.log(f"note: that is {sequences:,} sequences, the scale of the paper's multi-GPU "
                 "recipe (the defaults); the first progress line, after step 1, says how "
                 "long a step takes here and what the run will cost. A CPU-sized run: the "
                 "README's walkthrough")

    # 4. The loop: batch -> train_step (layout, loss, backward, step) -> log.
    region_len = args.seq_len // args.regions
    per = args.micro_batch
    t0 = time.perf_counter()
    progress = Progress()
    try:
        for step in range(start, args.steps):
            # The batch: the step's rows and one k and offset, the same on every
            # process; micro-batch i of the rows goes to process i % world.
            g = torch.Generator().manual_seed(args.seed * 7_919 + step + 1)
            k, offset = sample_k_and_offset(args.k_max, region_len, generator=g)
            rows = rows_of_step(step, global_batch=args.batch_size, n_rows=len(seqs),
                                seed=args.seed)
            micro = [rows[i * per:(i + 1) * per]
                     for i in range(dist.rank, len(rows) // per, dist.world)]
            micro = [(seqs[r].long(), None if trained is None else trained[r]) for r in micro]

            # The rate this step trains at: train_step moves the schedule on.
            lr = optimizer.param_groups[0]["lr"]
            stats = train_step(student, teacher, optimizer, scheduler, micro, k=k,
                               offset=offset, args=args, dist=dist, mask_id=mask_id, pad=pad)

            done = step + 1
            last = done == args.steps
            elapsed = time.perf_counter() - t0
            if dist.main and (done % args.log_every == 0 or last):
                with open(out / "log.jsonl", "a") as f:
                    f.write(json.dumps({"step": done, **stats, "lr": lr}) + "\n")
            if dist.main and progress.due(last):
                per_step = elapsed / (done - start)
                tokens_per_s = args.batch_size * args.seq_len / per_step
                dist.log(f"step {done}/{args.steps} | loss {stats['loss']:.4f} "
                         f"| agree {stats['agree']:.3f} | k {stats['k']:2d} | lr {lr:.2e} "
                         f"| grad {stats['grad_norm']:.3f} | {per_step:.2f} s/step, "
                         f"{tokens_per_s:,.0f} tok/s "
                         f"| ETA {format_seconds(per_step * (args.steps - done))}")

            if done % args.save_every == 0 or last:
                saved = save_checkpoint(student, optimizer, scheduler, done, args, dist)
                # Weights and AdamW's state: 3x the model in float32.
                if dist.main:
                    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
                    dist.log(f"saved checkpoint {saved} ({size / 2**30:.2f} GB; the last "
                             f"{args.keep} are kept)")
    except KeyboardInterrupt:
        # Checkpoints are atomic: the last one is whole.
        saved = latest_checkpoint(out)
        where = f"the last checkpoint is {saved}" if saved else "no checkpoint yet"
        raise KeyboardInterrupt(f"{where}; run the same command with --resume to "
                                "continue") from None

    # 5. A Hugging Face folder, <mask> in it.
    return export(student, tok, out / "final", args, dist)


def train_step(student, teacher, optimizer, scheduler, micro, k: int, offset: int,
               args, dist: Dist, mask_id: int, pad: int) -> dict:
    """One optimizer step on this process's micro-batches, each (rows, trained
    tokens or None): layout -> loss -> backward for each, then clip and step ->
    the step's stats."""
    # 1. Layout: each micro-batch becomes its k-token problems. The padding
    # token ends a row's text too: it is the layout's EOS.
    batches = [mtp_layout(rows, k=k, offset=offset, n_regions=args.regions,
                          mask_id=mask_id, eos_id=pad, pad_id=pad, trained=trained)
               for rows, trained in micro]

    # 2. Weights: mtp_loss averages over its micro-batch's valid predictions;
    # weighted by their share of the global batch's, the gradient is one mean
    # over it however it is split (FSDP averages over processes: hence * world).
    # They are counted on the host, before moving.
    counts = [int(b.valid.sum()) for b in batches]
    batches = [b.to(dist.device) for b in batches]
    n_global = max(1.0, dist.all_sum(sum(counts)))

    # 3. Loss and backward, per micro-batch. Each backward reduce-scatters at
    # once: no full gradient is held. Sharded, FSDP2's MixedPrecisionPolicy
    # casts; else autocast does.
    autocast = torch.autocast(dist.device.type, dtype=dist.dtype,
                              enabled=dist.dtype != torch.float32 and not dist.sharded)
    loss_sum = 0.0
    agree = 0.0
    for batch, n in zip(batches, counts):
        with autocast:
            if uses_adapter(args):
                # mtp_loss with the student's adapter switched off as teacher,
                # computing the base model's ground-truth rows once, without
                # gradient
                loss, stats = gated_mtp_loss(student, batch, mode=args.mode)
            else:
                loss, stats = mtp_loss(student, teacher, batch, mode=args.mode,
                                       prefix_ntp_weight=args.prefix_ntp_weight)
        (loss * (n / n_global) * dist.world).backward()
        loss_sum += stats["loss"] * n
        # Per prediction j: the share of argmax == target (NaN: no target there).
        accs = [a for a in stats["acc"] if a == a]
        if accs:
            agree += n * (sum(accs) / len(accs))

    # 4. Clip and step.
    grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip)
    # FSDP2: a DTensor.
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

    return {"loss": dist.all_sum(loss_sum) / n_global,
            "agree": dist.all_sum(agree) / n_global,
            "grad_norm": float(grad_norm), "k": batches[0].k,
            "offset": batches[0].offset, "n_pred": int(n_global)}


def start_or_resume(student, optimizer, scheduler, args, dist: Dist) -> int:
    """The step this run starts at, with --out made ready: 0, after clearing an earlier
    run with --overwrite (check_args made sure it was asked for), or with --resume the
    last checkpoint's, restored."""
    out = Path(args.out)
    log = out / "log.jsonl"
    start = 0
    if args.overwrite and dist.main:
        for folder in ("checkpoints", "final"):
            shutil.rmtree(out / folder, ignore_errors=True)
        log.unlink(missing_ok=True)

    if args.resume and (ckpt := latest_checkpoint(out)) is not None:
        start, planned = load_checkpoint(ckpt, student, optimizer, scheduler, args)
        if start > args.steps:
            raise ValueError(f"--steps {args.steps}: the run in {out} has done {start} "
                             f"steps already; resume it with --steps {start} or more")
        # From here the rate is this run's schedule, whatever --steps was.
        scheduler.last_epoch = start - 1
        scheduler.step()
        dist.log(f"resumed from {ckpt} at step {start} of {args.steps}")
        if planned != args.steps:
            rate = optimizer.param_groups[0]["lr"]
            dist.log(f"note: steps 1-{start} followed the schedule of a {planned}-step run; "
                     f"from here the learning rate follows a {args.steps}-step one "
                     f"({rate:.2e} at step {start + 1})")
        # The steps after `start` are done again: their log rows go.
        if dist.main and log.is_file():
            kept = [line + "\n" for line in log.read_text().splitlines()
                    if json.loads(line)["step"] <= start]
            atomic_save(lambda p: Path(p).write_text("".join(kept)), log)
    elif args.resume:
        dist.log(f"--resume: no checkpoint in {out / 'checkpoints'}, starting at step 0")

    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "train_args.json", vars(args))
    return start

def rows_of_step(step: int, global_batch: int, n_rows: int, seed: int) -> list[int]:
    """Row indices of the global batch of step `step` (0-based): a seeded
    permutation per epoch."""
    first = step * global_batch
    epochs = range(first // n_rows, (first + global_batch - 1) // n_rows + 1)
    order = torch.cat([
        torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
        for e in epochs])
    return order[first - epochs[0] * n_rows:][:global_batch].tolist()


# === eval: GSM8K, scored as lm-evaluation-harness's `gsm8k_cot` scores it =====
# Prompt: Wei et al.'s (2022) 8 exemplars "Q: ...\nA: ... The answer is N.",
# then "Q: {question}\nA:".
#   strict-match      the FIRST match of `The answer is (\-?[0-9\.\,]+).` -- the last "." is
#                     an unescaped regex dot (ANY one character), so with nothing after the
#                     number the group gives back its last digit: a final "The answer is 42"
#                     gives "4";
#   flexible-extract  the LAST match of `(-?[$0-9.,]{2,})|(-?[0-9]+)`, the last number-like
#                     run.
# Before comparing, extraction and gold answer (the text after "####") lose
# every "," and "$", all up to "#### " and one trailing ".", and are
# lower-cased. Standard error: sqrt(sample var / n).
GSM8K_EXEMPLARS = json.loads((PROMPTS / "gsm8k_cot_exemplars.json").read_text("utf-8"))
GSM8K_STOP_STRINGS = ("Q:", "</s>", "<|im_end|>")
STRICT_MATCH = re.compile(r"The answer is (\-?[0-9\.\,]+).")
FLEXIBLE_EXTRACT = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED_BEFORE_COMPARING = (",", r"\$", r"(?s).*#### ", r"\.$")


def fewshot_prompt(question: str, n_shot: int = 8) -> str:
    shots = [f"Q: {e['question']}\nA: {e['answer']}" for e in GSM8K_EXEMPLARS[:n_shot]]
    return "\n\n".join(shots + [f"Q: {question}\nA:"])


def score(completion: str, gold: str) -> dict:
    def extract(regex, select):
        # Match `select` (0: first, -1: last); of its groups, the non-empty one.
        found = [m if isinstance(m, str) else next(g for g in m if g)
                 for m in regex.findall(completion)]
        return found[select].strip() if found else "[invalid]"

    def normalize(answer):
        for pattern in IGNORED_BEFORE_COMPARING:
            answer = re.sub(pattern, "", answer)
        return answer.lower()

    strict = extract(STRICT_MATCH, 0)
    flexible = extract(FLEXIBLE_EXTRACT, -1)
    return {"strict": strict, "flexible": flexible,
            "strict_ok": normalize(strict) == normalize(gold),
            "flexible_ok": normalize(flexible) == normalize(gold)}


def mean_and_stderr(values):
    """(mean, standard error of the mean)."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, statistics.stdev(values) / math.sqrt(len(values))


def completion_of(tok: Tokenizer, gen, stop_ids):
    """(text, tokens, forward passes) as if decoding had stopped at the first
    stop string: generate stops at stop TOKENS only, so a stop STRING ("Q:")
    ends the text with the pass that completed it."""
    tokens = gen.tokens
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    text = tok.decode(tokens)
    # Up to the first stop string, made by the first pass whose text has it.
    cut = min((text.split(s)[0] for s in GSM8K_STOP_STRINGS), key=len)
    if cut != text:
        for passes, end in enumerate(gen.boundaries, 1):
            if any(s in tok.decode(gen.tokens[:end]) for s in GSM8K_STOP_STRINGS):
                return cut, end, passes
    return cut, len(gen.tokens), gen.forward_passes


def evaluate(args) -> list[dict]:
    modes = decode_modes(static_ks=args.static_k, taus=args.taus, k_max=args.k_max,
                         lossless_k=args.lossless_k)
    if not modes:
        raise ValueError("nothing to evaluate: give --static-k and/or --taus")
    model, tok, mask_id, fmt, stop_ids = load_for_inference(args)
    questions = read_rows(args.data, [("question", "answer")])[: args.limit or None]

    # Checked before any decoding, not after the first decoder.
    need_mask = list(dict.fromkeys(m.kind for m in modes if m.block > 1))
    if need_mask and mask_id is None:
        raise ValueError(f"{args.model} has no <mask> token, which {' and '.join(need_mask)} "
                         "decoding needs: evaluate it with --static-k 1 --taus (greedy only), "
                         "or tune it first")

    # 1. Prompts; gold answers: the text after the last "####".
    golds = [answer.split("####")[-1].strip() for _, answer in questions]
    fewshot = args.prompt_style == "fewshot"
    name = model_name(args.model)
    if fewshot:
        title = f"{name}: GSM8K chain of thought, {args.n_shot}-shot"
        prompts = [start_tokens(tok, fmt) + tok.encode(fewshot_prompt(q, args.n_shot))
                   for q, _ in questions]
    else:
        title = f"{name}: GSM-style questions, zero-shot ({fmt} format)"
        prompts = [prompt_tokens(tok, fmt, q) for q, _ in questions]

    # An earlier eval's k=1 completions (the untuned model's).
    reference = None
    if args.reference:
        path = Path(args.reference) / "samples.jsonl"
        greedy = [r for r in read_rows(path) if r.get("decoding") == "k=1 (greedy)"]
        if len(greedy) < len(golds):
            raise ValueError(f"{path}: {len(greedy)} greedy (k=1) completions, {len(golds)} "
                             "needed; run that eval with --static-k 1")
        greedy.sort(key=lambda r: r["index"])
        reference = [r["completion"] for r in greedy][:len(golds)]

    # 2. Where the results go, and the table's head.
    meta = {"model": args.model, "data": args.data, "prompt_style": args.prompt_style,
            "format": fmt, "n_shot": args.n_shot if fewshot else 0,
            "max_new_tokens": args.max_new_tokens,
            "device": str(next(model.parameters()).device),
            **provenance(next(model.parameters()).dtype)}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    same = reference is not None
    columns = ("decoding | flexible-extract acc. | strict-match acc. | "
               "effective k (mean ± std) | tokens/s")
    header = [f"| {columns} |" + (" same as reference |" if same else ""),
              "|---|---|---|---|---|" + "---|" * same]
    print(f"### {title}", *header, sep="\n", flush=True)

    # 3. Each decoder over all prompts, longest first; table: results.md's rows.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    ordered = [prompts[i] for i in order]
    results = []
    table = []
    samples_text = []
    try:
        for mode in modes:
            gens, seconds = decode_with_progress(model, ordered, mode, mask_id, stop_ids, args)
            samples = [None] * len(order)
            for i, gen in zip(order, gens):
                text, n_tokens, passes = completion_of(tok, gen, stop_ids)
                samples[i] = {"index": i, "completion": text, "gold": golds[i],
                              "tokens": n_tokens, "passes": passes,
                              "effective_k": n_tokens / max(1, passes),
                              **score(text, golds[i])}

            row = result_row(mode, samples, seconds, args.batch_size)
            # How often the answer is the reference's, word for word.
            if same:
                row["same_as_reference"] = mean_and_stderr(
                    s["completion"] == r for s, r in zip(samples, reference))[0]
            results.append(row)
            table.append(table_line(row))
            print(table[-1], flush=True)
            samples_text += [json.dumps({"decoding": row["decoding"], **s}) + "\n"
                             for s in samples]

            # Written after each decoder: an interrupted eval keeps those done.
            write_eval(out, title, meta, header, table, results, samples_text, n=len(golds),
                       batch_size=args.batch_size, same=same)
    except KeyboardInterrupt:
        kept = "nothing written"
        if results:
            kept = f"{out} holds the results of the {len(results)} finished decoder(s)"
        raise KeyboardInterrupt(kept) from None
    print(f"wrote {out / 'results.md'}, results.json, pareto.png, samples.jsonl")
    return results


def result_row(mode: DecodeConfig, samples, seconds, batch_size) -> dict:
    """One decoder's results: accuracies with standard errors, effective k,
    tokens/s."""
    flex, flex_se = mean_and_stderr(s["flexible_ok"] for s in samples)
    strict, strict_se = mean_and_stderr(s["strict_ok"] for s in samples)
    eff = [s["effective_k"] for s in samples]
    tokens = sum(s["tokens"] for s in samples)
    passes = sum(s["passes"] for s in samples)

    greedy = mode.describe() == "greedy"
    decoding = "k=1 (greedy)" if greedy else mode.describe()
    # ConfAdapt has a threshold and a k_max instead of one k.
    row = {"decoding": decoding, "kind": "greedy" if greedy else mode.kind, "k": mode.block,
           "tau": None, "k_max": None}
    if mode.kind == "confadapt":
        row.update(k=None, tau=mode.tau, k_max=mode.k_max)

    return {**row, "n": len(samples), "flexible_acc": flex, "flexible_se": flex_se,
            "strict_acc": strict, "strict_se": strict_se,
            "effective_k_mean": statistics.mean(eff),
            "effective_k_std": statistics.pstdev(eff),
            "effective_k_overall": tokens / max(1, passes),
            "tokens_per_second": tokens / max(seconds, 1e-9), "batch_size": batch_size}


def table_line(row):
    """results.md's line of one decoder: accuracies in % ± standard error."""
    line = (f"| {row['decoding']} "
            f"| {100 * row['flexible_acc']:.1f} ± {100 * row['flexible_se']:.1f} "
            f"| {100 * row['strict_acc']:.1f} ± {100 * row['strict_se']:.1f} "
            f"| {row['effective_k_mean']:.2f} ± {row['effective_k_std']:.2f} "
            f"| {row['tokens_per_second']:,.1f} |")
    if "same_as_reference" in row:
        line += f" {100 * row['same_as_reference']:.0f}% |"
    return line


def decode_with_progress(model, prompts, mode: DecodeConfig, mask_id, stop_ids, args):
    """generate() in parts of 4 batches, a progress line between them ->
    (generations, decoding seconds, prefill excluded). A part's last passes run
    with a partly empty batch, so tokens/s is a little under one continuous
    generate() over all prompts."""
    part = 4 * args.batch_size
    gens = []
    seconds = 0.0
    progress = Progress()
    for first in range(0, len(prompts), part):
        done, stats = generate(model, prompts[first:first + part], args.max_new_tokens,
                               mode=mode, mask_id=mask_id, stop_ids=stop_ids,
                               batch_size=args.batch_size)
        gens += done
        seconds += stats.seconds - stats.prefill_seconds
        if len(gens) < len(prompts) and progress.due():
            print(f"  {mode.describe()}: {len(gens)}/{len(prompts)} answers, "
                  f"{format_seconds(seconds)}", file=sys.stderr, flush=True)
    return gens, seconds


def write_eval(out, title, meta, header, table, results, samples_text, n,
               batch_size, same):
    write_json(out / "results.json", {"meta": meta, "results": results})
    md = [f"### {title}", "", *header, *table]
    note = (f"n = {n} questions; accuracy in % ± standard error; effective k = tokens / "
            "forward passes per completion (not a wall-clock speed-up); tokens/s = decoding "
            f"throughput at batch size {batch_size}, prefill excluded")
    if same:
        note += "; same as reference = share of answers identical to the reference's k=1 answer"
    md += ["", note + ".", ""]
    atomic_save(lambda p: Path(p).write_text("\n".join(md), encoding="utf-8"),
                out / "results.md")
    samples = "".join(samples_text)
    atomic_save(lambda p: Path(p).write_text(samples, encoding="utf-8"),
                out / "samples.jsonl")
    pareto_plot(results, out / "pareto.png", title)


def pareto_plot(rows, path, title):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot(xlabel="effective k (tokens per forward pass)",
                         ylabel="accuracy, flexible-extract (%)")
    for name, kinds, marker, label in [("static k", ("greedy", "static"), "o", "k={k}"),
                                       ("ConfAdapt", ("confadapt",), "s", "τ={tau:g}"),
                                       ("lossless", ("lossless",), "D", "k≤{k}")]:
        pts = sorted((r for r in rows if r["kind"] in kinds),
                     key=lambda r: r["effective_k_mean"])
        x = [r["effective_k_mean"] for r in pts]
        y = [100 * r["flexible_acc"] for r in pts]
        if pts:
            ax.errorbar(x, y, yerr=[100 * r["flexible_se"] for r in pts], marker=marker,
                        capsize=3, label=name)
        for r, p in zip(pts, zip(x, y)):
            ax.annotate(label.format(**r), p, xytext=(4, 4), textcoords="offset points",
                        fontsize=7)
    # The Pareto front: points no other point matches or beats on both axes.
    points = [(r["effective_k_mean"], 100 * r["flexible_acc"]) for r in rows]
    front = sorted(p for p in set(points)
                   if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points))
    ax.plot([x for x, _ in front], [y for _, y in front], "k--", lw=0.8, alpha=0.5,
            label="Pareto front")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def model_name(path):
    """A model folder's last two path parts, as titles name it."""
    return "/".join(Path(path).resolve().parts[-2:])


def load_for_inference(args):
    """(model, tokenizer, mask id or None, prompt format, stop ids) of
    --model."""
    device = parse_device(args.device)
    model, tok, mask_id, _ = load_model(args.model, device,
                                        compute_dtype(device.type, args.dtype))
    fmt = args.format
    if fmt == "auto":
        fmt = default_format(tok, model.config.model_type)
    # The format's end of turn stops decoding too.
    stop_ids = stop_ids_of(model, tok) | {end_token(tok, fmt)}
    return model, tok, mask_id, fmt, stop_ids


# === analyze: is this domain predictable enough to be worth tuning? ===========
# The base model answers the domain's prompts greedily; c_t is each answer token's top-1
# probability given the true prefix. ConfAdapt accepts a mask prediction when the TUNED model
# is at least tau sure of it without seeing the tokens just before. Two bounds on that:
#   per-token (optimistic)  prediction j of a pass is accepted while every c it covers is
#                           >= tau;
#   joint (conservative)    accepted while c_t * c_{t+1} * ... * c_{t+j} >= tau: the
#                           probability of the whole greedy run, a lower bound on the
#                           marginal of its last token.
# Both read the UNTUNED model's confidences, and tuning with the hard teacher
# sharpens them: on this project's SmolLM2 word problems the estimate at tau 0.9
# was 1.2-1.3 tokens per pass and tuned models reached 1.8-2.5. Read them as a
# floor of what tuning can give, not a forecast.
def simulated_passes(conf: list[float], tau: float, k_max: int, joint: bool) -> int:
    """Forward passes ConfAdapt(tau, k_max) needs for an answer with these
    confidences (per token or joint)."""
    t = 0
    passes = 0
    while t < len(conf):
        window = conf[t:t + k_max]
        # Joint: c_t, c_t c_{t+1}, c_t c_{t+1} c_{t+2}, ...
        if joint:
            window = [math.prod(window[:j + 1]) for j in range(len(window))]
        t += accept_confadapt(window, tau)
        passes += 1
    return passes


def analyze(args) -> dict:
    model, tok, _, fmt, stop_ids = load_for_inference(args)
    if args.domains:
        # Held-out prompts generated in code.
        groups = {domain: domain_prompts(domain, args.limit, "test")
                  for domain in args.domains}
    else:
        # GSM8K, MetaMathQA or generic rows.
        questions = read_rows(args.data, [("question",), ("query",), ("prompt",)])
        groups = {Path(args.data).name: [q for (q,) in questions][: args.limit or None]}

    device = next(model.parameters()).device
    reports = {}
    for name, questions in groups.items():
        prompts = [prompt_tokens(tok, fmt, q) for q in questions]
        gens, _ = generate(model, prompts, args.max_new_tokens, DecodeConfig("greedy"),
                           stop_ids=stop_ids, batch_size=args.batch_size)
        # Per answer: the top-1 probability at each of its tokens, one
        # teacher-forced pass over prompt + answer.
        confs = []
        for prompt, gen in zip(prompts, gens):
            if not gen.tokens:
                continue
            with torch.inference_mode():
                ids = torch.tensor([prompt + gen.tokens], device=device)   # (1, P + A)
                index = torch.arange(len(prompt) - 1, ids.shape[1] - 1, device=ids.device)
                probs = model(ids, output_index=index[None]).float().softmax(-1)  # (1, A, V)
                confs.append(probs.max(-1).values[0].tolist())

        reports[name] = predictability(confs, args.taus, args.k_max)

    taus = " | ".join(f"tau {t:g}" for t in args.taus)
    md = [f"### Predictability for {model_name(args.model)}", "",
          f"Greedy answers (at most {min(args.max_new_tokens, model.config.max_seq_len)} "
          f"tokens) to held-out prompts, {fmt} format; "
          f"ConfAdapt k_max = {args.k_max}; effective k estimated from the untuned model's "
          "confidences (a floor: tuning sharpens them), joint to per-token.",
          "",
          f"| prompts | answers | tokens | mean confidence | {taus} |",
          "|---|---|---|---|" + "---|" * len(args.taus)]
    for name, r in reports.items():
        ranges = " | ".join(f"{e['effective_k_joint']:.2f}-{e['effective_k_per_token']:.2f}"
                            for e in r["estimates"])
        md.append(f"| {name} | {r['answers']} | {r['tokens']} "
                  f"| {r['mean_confidence']:.3f} | {ranges} |")
    md += [""] + [f"- {name}: {r['verdict']}" for name, r in reports.items()] + [""]

    print("\n".join(md))
    report = {"model": args.model, "format": fmt, "k_max": args.k_max,
              "max_new_tokens": args.max_new_tokens, "domains": reports}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "analysis.json", report)
        (out / "analysis.md").write_text("\n".join(md), encoding="utf-8")
    return report


def predictability(confs, taus, k_max):
    """One domain's report: effective k both ways per tau, and a verdict at tau
    0.9."""
    flat = [c for cs in confs for c in cs]
    if not flat:
        raise ValueError("the model produced no answer tokens")

    def effective_k(tau: float, joint: bool) -> float:
        passes = sum(simulated_passes(cs, tau, k_max=k_max, joint=joint) for cs in confs)
        return len(flat) / passes

    rows = [{"tau": tau, "share_confident": sum(c >= tau for c in flat) / len(flat),
             "effective_k_per_token": effective_k(tau, joint=False),
             "effective_k_joint": effective_k(tau, joint=True)} for tau in taus]

    ref = min(rows, key=lambda r: abs(r["tau"] - 0.9))
    worth = ref["effective_k_per_token"] >= 2.0
    verdict = (f"at tau={ref['tau']:g} the untuned model's own confidences already allow "
               f"about {ref['effective_k_joint']:.1f} (joint) to "
               f"{ref['effective_k_per_token']:.1f} (per token) tokens per pass; ")
    if worth:
        verdict += "predictable enough to be worth tuning."
    else:
        verdict += ("a floor: tuning sharpens confidences (SmolLM2's word problems: 1.2-1.3 "
                    "here, 1.8-2.5 after tuning).")
    return {"answers": len(confs), "tokens": len(flat), "mean_confidence": sum(flat) / len(flat),
            "estimates": rows, "worth_tuning": worth, "verdict": verdict}


# === data: training rows from the model itself ================================
# The hard teacher uses data only as prefixes (its targets are its own
# predictions), so the model's greedy answers to prompts of the target domains
# serve, from the distribution ConfAdapt decodes.
def make_data(args):
    model, tok, _, fmt, stop_ids = load_for_inference(args)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for domain in args.domains:
        questions = domain_prompts(domain, args.per_domain, args.split)
        prompts = [prompt_tokens(tok, fmt, q) for q in questions]
        try:
            gens, stats = generate(model, prompts, args.max_new_tokens, DecodeConfig("greedy"),
                                   stop_ids=stop_ids, batch_size=args.batch_size)
        except KeyboardInterrupt:
            kept = f"{out} not written"
            if rows:
                done = sorted({r["domain"] for r in rows})
                kept = f"{out} holds the {len(rows)} rows of {', '.join(done)}"
            raise KeyboardInterrupt(f"{kept}; {domain} and the domains after it were not "
                                    "made") from None

        for q, g in zip(questions, gens):
            finished = bool(g.tokens) and g.tokens[-1] in stop_ids
            answer = tok.decode(g.tokens[:-1] if finished else g.tokens)
            rows.append({"domain": domain, "prompt": q, "response": answer,
                         "finished": finished})
        cut = sum(not r["finished"] for r in rows if r["domain"] == domain)
        print(f"{domain}: {len(questions)} answers ({cut} cut at --max-new-tokens "
              f"{args.max_new_tokens}: marked unfinished, train skips them), "
              f"{sum(len(g.tokens) for g in gens):,} tokens, {stats.seconds:.0f} s",
              flush=True)

        # Written after each domain: Ctrl-C keeps them.
        text = "".join(json.dumps(r) + "\n" for r in rows)
        atomic_save(lambda p: Path(p).write_text(text, encoding="utf-8"), out)
    print(f"wrote {len(rows)} rows to {out}")


# === export: a Hugging Face folder any transformers-based stack loads =========
def export(student, tok: Tokenizer, path: Path, args, dist: Dist) -> Path:
    """A Hugging Face folder of the tuned model, or with the gated adapter the
    adapter's folder (its weights and config, naming the unchanged base model;
    mtp.cli.load_model reads both)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    adapter = uses_adapter(args)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                               ignore_frozen_params=adapter)
    state = get_model_state_dict(student, options=options)

    # Saved in the base model's dtype.
    base = read_json(os.path.join(args.model, "config.json"), "model config")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        base.get("dtype") or base.get("torch_dtype"), torch.float32)

    if dist.main:
        with torch.device("meta"):
            model = Transformer(student.config)
            if adapter:
                add_mask_adapter(model, args.adapter_rank, args.adapter_alpha,
                                 args.adapter_targets)
        # The adapter's tensors only; else all but a tied lm_head (not saved).
        model.load_state_dict(state, assign=True, strict=not adapter)
        if adapter:
            save_mask_adapter(model, path, args.model, dtype=dtype)
        else:
            save_pretrained(model, path, dtype=dtype)
            tok.save_pretrained(path)
            # Sampling defaults, stop ids.
            generation = Path(args.model) / "generation_config.json"
            if generation.is_file():
                shutil.copyfile(generation, path / generation.name)
        (path / "README.md").write_text(model_card(model.config, args), encoding="utf-8")

    dist.barrier()
    dist.log(f"exported {path}")
    return path


# Also marks our exports: export writes only over a folder whose card has it.
MODEL_CARD_TAGS = "tags: [multi-token-prediction, self-distillation]"


def model_card(cfg, args) -> str:
    how = f"{args.mode}-target self-distillation"
    if args.mode == "gt":
        how = "the naive ground-truth loss"
    where = ""
    if getattr(args, "response_only", False):
        where = ", targets in the responses only"
    decay = ""
    if getattr(args, "decay", 0):
        decay = f" then linear to 0 over the last {args.decay},"
    if uses_adapter(args):
        what = f"""# A gated mask adapter for multi-token prediction (not a LoRA)

A low-rank update (rank {args.adapter_rank}, alpha {args.adapter_alpha:g}, on \
{', '.join(args.adapter_targets)}) and a `<mask>` embedding for `{args.model}`, trained \
with {how} (arXiv 2602.06019). The update applies ONLY at input positions holding \
`<mask>` (token {cfg.mask_token_id}); every other position computes exactly the base \
model, so its own predictions are unchanged. A plain LoRA loader would apply it \
everywhere: load it with this project's `mtp.cli.load_model` (`mask_adapter.json` names the \
base folder). Prompt format"""
        library = "mtp-distill"
    else:
        what = f"""# Multi-token prediction by self-distillation

`{args.model}` tuned on {', '.join(f'`{d}`' for d in args.data)} with {how} \
(arXiv 2602.06019). One token is added, `<mask>` (`mask_token_id` {cfg.mask_token_id} \
in config.json): after the text and k-1 `<mask>`, `logits[0, -k:]` predict the next k \
tokens. Prompt format"""
        library = "transformers"
    return f"""---
library_name: {library}
{MODEL_CARD_TAGS}
---
{what} `{args.format}`. Decode with ConfAdapt (keep the leading predictions of top-1 \
probability >= tau), the prompt as the user's message: `python confadapt.py --model \
THIS_FOLDER --format {args.format} --prompt "..." --tau 0.9 --k-max {args.k_max}`.

Training: {args.steps} steps of {args.batch_size} sequences of {args.seq_len} tokens, k in \
[2, {args.k_max}], {args.regions} regions each{where}; AdamW lr {args.lr:g}, warm-up \
{args.warmup} steps,{decay} betas ({args.beta1}, {args.beta2}), weight decay \
{args.weight_decay}, clip {args.clip}.
"""


def export_checkpoint(args):
    # A run's folder: its latest checkpoint.
    ckpt = latest_checkpoint(args.checkpoint) or Path(args.checkpoint)
    if not (ckpt / "trainer.pt").is_file():
        raise FileNotFoundError(f"no training checkpoint (trainer.pt) in {args.checkpoint}")
    trainer = read_checkpoint(ckpt / "trainer.pt", "training checkpoint", weights_only=True)
    saved = argparse.Namespace(**trainer["args"])
    input_path(saved.model, "the base model this checkpoint was tuned from", folder=True)
    student, _, tok, _ = load_student_and_teacher(saved, Dist(), with_teacher=False)
    # Optimizer and scheduler are unused, but load_checkpoint restores them.
    opt = student.configure_optimizer(
        saved.lr, saved.weight_decay, (saved.beta1, saved.beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    load_checkpoint(ckpt, student, opt, scheduler, saved)
    return export(student, tok, Path(args.out), saved, Dist())


# --- plumbing: processes, dtypes, loading, sharding, checkpoints, checks, CLI --

@dataclass
class Dist:
    """The process group as train sees it: one process, or one of torchrun's."""
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    # What the matrix multiplications compute in.
    dtype: torch.dtype = torch.float32
    # Under torchrun: FSDP2, at any world size.
    sharded: bool = False
    # Rank 0 alone reads, logs and writes files.
    main = property(lambda self: self.rank == 0)

    def log(self, message: str):
        if self.main:
            print(message, flush=True)

    def all_sum(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        if self.sharded:
            torch.distributed.all_reduce(t)
        return float(t)

    def barrier(self):
        if self.sharded:
            torch.distributed.barrier()


def setup_processes(device: str, dtype: str = "auto") -> Dist:
    from datetime import timedelta
    device = parse_device(device)
    torchrun = "WORLD_SIZE" in os.environ
    compute = compute_dtype(device.type, dtype)
    # Under torchrun: one GPU per process, whatever --device named.
    if device.type == "cuda":
        if torchrun:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not torchrun:
        return Dist(device=device, dtype=compute)

    # Rank 0 alone loads and exports while the others wait: on a slow disk,
    # longer than NCCL's default 10 minutes.
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, timeout=timedelta(hours=1))
    # gloo computes in float32.
    if device.type == "cpu" and dtype == "auto":
        compute = torch.float32
    return Dist(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(),
                device=device, dtype=compute, sharded=True)


def compute_dtype(device_type: str, dtype: str = "auto") -> torch.dtype:
    """--dtype auto: bfloat16 on GPUs and CPUs with native bfloat16 arithmetic
    (elsewhere slow), else float32."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device_type == "cuda":
        native = native_bfloat16_gpu(torch.device("cuda"))
    else:
        # Linux lists the CPU's flags.
        cpuinfo = Path("/proc/cpuinfo")
        flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
        native = "avx512_bf16" in flags or "amx_bf16" in flags
    return torch.bfloat16 if native else torch.float32


# Precision. The student keeps float32 master weights (lr 1e-5 updates vanish in
# bfloat16's 8-bit mantissa), computing in --dtype (FSDP2's MixedPrecisionPolicy
# when sharded, else torch.autocast); the teacher never changes, so it is stored
# in the compute dtype. Sharding. Every rank builds both models on the meta
# device (no memory), shards each block (one all-gather unit), then the root;
# rank 0 alone reads the checkpoint, broadcasting its weights straight into
# every process's shards.
def uses_adapter(args) -> bool:
    """--adapter gated-lora; the arguments of a checkpoint from before that flag
    say nothing."""
    return getattr(args, "adapter", "none") != "none"


def load_student_and_teacher(args, dist: Dist, with_teacher: bool = True):
    """(student, teacher or None, tokenizer, mask id) on dist.device, sharded
    when dist.sharded. With the gated adapter the base is frozen and there is no
    teacher to build: it is the student with its adapter off (gated_mtp_loss)."""
    tok = load_tokenizer(args.model)
    full = None
    meta = [None]
    if dist.main:
        full = from_pretrained(args.model, dtype=torch.float32)
        meta = [(full.config, add_mask_token(full, tok))]
    # Rank 0's config and mask id on every rank (its tokenizer has <mask>).
    if dist.sharded:
        torch.distributed.broadcast_object_list(meta, src=0)
    cfg, mask_id = meta[0]
    tok.add_special_token("<mask>", mask_id)
    adapter = uses_adapter(args)
    if adapter:
        settings = (args.adapter_rank, args.adapter_alpha, args.adapter_targets)

    # One process. With the adapter, the frozen base is in the compute dtype,
    # like a teacher copy, and the adapter in float32.
    if not dist.sharded and adapter:
        full.to(device=dist.device, dtype=dist.dtype)
        add_mask_adapter(full, *settings)
        return full.train(), None, tok, mask_id
    # Without it, a teacher copy is made on the CPU, then moved.
    if not dist.sharded:
        teacher = None
        if with_teacher:
            teacher = frozen_teacher(full).to(device=dist.device, dtype=dist.dtype)
        return full.to(dist.device).train(), teacher, tok, mask_id

    # Sharded: every rank the same modules; rank 0's values arrive below.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        student = Transformer(cfg)
    if adapter:
        add_mask_adapter(student, *settings)
        if dist.main:
            add_mask_adapter(full, *settings)
    models = [student]
    teacher = None
    if with_teacher and not adapter:
        teacher = frozen_teacher(student).to(dist.dtype)
        models.append(teacher)
    # A mesh for the device: fully_shard's default would put a `--device cpu`
    # run's shards on a GPU.
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    mp = MixedPrecisionPolicy(param_dtype=dist.dtype, reduce_dtype=torch.float32)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for model in models:
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        # FSDP2 keeps a root's parameters gathered after its forward, for the
        # backward that follows; the teacher has no backward, so its embedding
        # and output layer would stay whole on every rank unless told to reshard
        # (None: FSDP2's default).
        reshard = True if model is teacher else None
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        # RoPE frequencies are computed again.
        model.to_empty(device=dist.device)
        set_model_state_dict(model, full.state_dict() if dist.main else {}, options=from_rank0)
    return student.train(), teacher, tok, mask_id


# A checkpoint is checkpoints/step_000123/: torch.distributed.checkpoint's files
# (each process its shards of model and optimizer state) and trainer.pt (step,
# scheduler, CPU RNG, arguments), renamed from a temporary name when complete,
# then named in `latest`: a crash leaves the last one whole.
RESUME_MUST_MATCH = ("model", "data", "format", "seq_len", "response_only", "mode",
                     "prefix_ntp_weight", "adapter", "k_max", "regions", "batch_size", "lr",
                     "warmup", "decay", "weight_decay", "beta1", "beta2", "seed")


def save_checkpoint(student, optimizer, scheduler, step: int, args, dist: Dist) -> Path:
    import torch.distributed.checkpoint as dcp
    root = Path(args.out) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    if dist.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state, _ = checkpoint_state(student, optimizer, args)
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    # No GPU RNG state: nothing draws on it.
    if dist.main:
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "args": vars(args),
                    "rng_cpu": torch.get_rng_state()}, tmp / "trainer.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_save(lambda p: Path(p).write_text(final.name + "\n"), root / "latest")
        old = sorted(p for p in root.glob("step_*") if p.name != final.name)
        for stale in old[: max(0, len(old) - (args.keep - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def checkpoint_state(student, optimizer, args):
    """What a checkpoint holds of model and AdamW (this process's shards), and
    the options that say so: every weight, or with the gated adapter only the
    trained ones."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    adapter = uses_adapter(args)
    options = StateDictOptions(ignore_frozen_params=adapter, strict=not adapter)
    model, optim = get_state_dict(student, optimizer, options=options)
    return {"model": model, "optim": optim}, options


def latest_checkpoint(out) -> Path | None:
    pointer = Path(out) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "trainer.pt").is_file():
        return None
    return path


def load_checkpoint(path: Path, student, optimizer, scheduler, args):
    """Restore model, optimizer, scheduler and RNG from `path` if the run's
    settings match -> (steps done, the --steps that run was asked for)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    trainer = read_checkpoint(path / "trainer.pt", "training checkpoint", weights_only=True)

    def setting(name, run: dict):
        # Paths compare as real paths; a run from before --adapter had none.
        value = run.get(name, "none" if name == "adapter" else None)
        if name not in ("model", "data") or value is None:
            return value
        paths = [value] if isinstance(value, str) else value
        return [os.path.realpath(p) for p in paths]

    old = trainer["args"]
    new = vars(args)
    keys = RESUME_MUST_MATCH
    if setting("adapter", new) != "none":
        keys += ("adapter_rank", "adapter_alpha", "adapter_targets")
    changed = [f"--{k.replace('_', '-')} {setting(k, old)} -> {setting(k, new)}"
               for k in keys if setting(k, old) != setting(k, new)]
    if changed:
        raise ValueError(f"cannot resume from {path}: settings differ from the interrupted "
                         f"run ({'; '.join(changed)})")
    state, options = checkpoint_state(student, optimizer, args)
    try:
        dcp.load(state, checkpoint_id=str(path))
    # dcp wraps the reader's error in its own exception type.
    except Exception as e:
        raise ValueError(f"cannot read the checkpoint {path}: truncated or corrupt "
                         f"({type(e).__name__}); resume from an earlier one by pointing "
                         f"{path.parent}/latest at it") from None
    set_state_dict(student, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(trainer["scheduler"])
    # Per-GPU states, where saved, are unused.
    torch.set_rng_state(trainer["rng_cpu"])
    return trainer["step"], trainer["args"]["steps"]


def training_pairs(args, dist: Dist):
    """(prompt, response) pairs of every --data file, without the rows `data`
    marked unfinished (answers cut at its --max-new-tokens: a cut answer would
    teach the model to stop mid-text)."""
    # MetaMathQA, or generic.
    fields = [("query", "response"), ("prompt", "response")]
    pairs = []
    unfinished = 0
    for path in args.data:
        rows = read_rows(path)
        finished = [row for row in rows if row.get("finished") is not False]
        unfinished += len(rows) - len(finished)
        if finished:
            pairs += fields_of(finished, path, fields)
    if unfinished:
        dist.log(f"skipped {unfinished:,} rows marked unfinished (answers cut at data's "
                 "--max-new-tokens)")
    if not pairs:
        raise ValueError(f"every row of {' '.join(args.data)} is marked unfinished: nothing "
                         "to train on")
    return pairs[: args.limit_rows or None]


def check_targets(seqs, trained: torch.Tensor | None, tok, args, dist: Dist):
    """Refuse data and settings that give nothing to predict; warn when many
    rows give nothing. A row's targets are the tokens it trains on (`trained`:
    the response's, with --response-only) that are text: not the first token,
    not padding, not the end of a turn."""
    end = end_token(tok, args.format)
    pad = padding_token(tok, args.format)
    text = (seqs != pad) & (seqs != end)
    text[:, 0] = False
    if trained is not None:
        text &= trained
    empty = ~text.any(1)
    if not empty.any():
        return
    if trained is None:
        why = "no row has a token to predict"
    else:
        # Rows whose prompt fills them whole.
        cut = (~trained).all(1)
        why = (f"{int((empty & cut).sum()):,} rows are cut by --seq-len {args.seq_len} "
               f"before their response starts and {int((empty & ~cut).sum()):,} have an "
               "empty response")
        if empty.all():
            why += " (--response-only trains on response tokens only)"
    if empty.all():
        raise ValueError(f"no training targets in {' '.join(args.data)}: {why}")
    if empty.float().mean() >= 0.1:
        dist.log(f"warning: {int(empty.sum()):,} of {len(seqs):,} rows give no target "
                 f"({why}): they only take places in the batches")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="finetune_hf.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    taus = [0.99, 0.95, 0.9, 0.8, 0.7, 0.5]

    # All commands but export; max_new_tokens: the decoding ones (not train).
    def common(c, model_help, max_new_tokens=None):
        c.add_argument("--model", required=True,
                       help=f"Hugging Face layout folder{model_help}")
        c.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                       help="prompt format (auto: detect)")
        if max_new_tokens:
            c.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                           help="most tokens of each answer (data: a cut answer is marked "
                           "unfinished)")
            c.add_argument("--batch-size", type=positive_int, default=16,
                           help="prompts per batch")
        c.add_argument("--device", default="auto",
                       help="auto (cuda if any), cpu, cuda or cuda:N")
        c.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="compute dtype; auto (the default): bfloat16 where the hardware "
                       "computes it natively (a GPU from Ampere on, a CPU with AVX-512 BF16 or "
                       "AMX), else float32")
        c.add_argument("--threads", type=positive_int,
                       help="CPU threads (default: one per core)")

    t = sub.add_parser("train",
                       help="MTP fine-tuning by self-distillation (torchrun: multi-GPU)")
    common(t, " (config.json, safetensors, tokenizer)")
    g = t.add_argument_group("data")
    g.add_argument("--data", required=True, nargs="+",
                   help="rows (query or prompt, response): JSON array or JSONL")
    g.add_argument("--seq-len", type=number(int, 2), default=160, help="tokens per sequence")
    g.add_argument("--limit-rows", type=count, default=0,
                   help="use only the first N rows (0: all)")
    g.add_argument("--response-only", action="store_true",
                   help="predict response tokens only (the paper: all)")
    o = t.add_argument_group("optimization (defaults: the paper's full-scale recipe)")
    o.add_argument("--steps", type=positive_int, default=100_000, help="optimizer steps")
    o.add_argument("--batch-size", type=positive_int, default=128,
                   help="per step, all processes")
    o.add_argument("--micro-batch", type=positive_int, default=8,
                   help="per forward pass and process")
    o.add_argument("--lr", type=positive_float, default=1e-5,
                   help="peak learning rate (AdamW)")
    o.add_argument("--warmup", type=count, default=2000, help="linear warm-up steps")
    o.add_argument("--decay", type=count, default=0,
                   help="lr linearly to 0 over the last N steps (the paper: 0)")
    o.add_argument("--weight-decay", type=number(float, 0), default=0.1,
                   help="AdamW weight decay")
    o.add_argument("--beta1", type=number(float, 0, 0.9999), default=0.9, help="AdamW beta1")
    o.add_argument("--beta2", type=number(float, 0, 0.9999), default=0.95,
                   help="AdamW beta2")
    o.add_argument("--clip", type=positive_float, default=1.0,
                   help="gradient norm clipping")
    o.add_argument("--seed", type=count, default=0,
                   help="data order and every step's k and offset")
    m = t.add_argument_group("multi-token prediction")
    m.add_argument("--mode", default="hard", choices=LOSSES,
                   help="hard / soft: self-distillation; gt: naive ablation")
    m.add_argument("--k-max", type=number(int, 2), default=16,
                   help="k is drawn uniformly from [2, k_max] every step")
    m.add_argument("--regions", type=positive_int,
                   help="MTP problems per sequence (default seq_len / (2 k_max))")
    m.add_argument("--prefix-ntp-weight", type=number(float, 0), default=0.0,
                   help="plus this much plain NTP loss")
    m.add_argument("--adapter", default="none", choices=("none", "gated-lora"),
                   help="none (the default, the paper's recipe): tune every weight against "
                   "a frozen copy; gated-lora: freeze the model and train a low-rank update "
                   "that acts only at <mask> positions (the model's own predictions stay "
                   "exactly the base model's; the teacher is the base itself, no copy); "
                   "final/ then holds the adapter, not a model")
    m.add_argument("--adapter-rank", type=positive_int, default=32,
                   help="gated-lora: rank of each update")
    m.add_argument("--adapter-alpha", type=positive_float, default=64.0,
                   help="gated-lora: the update is scaled by alpha / rank")
    m.add_argument("--adapter-targets", nargs="+", choices=ADAPTER_TARGETS,
                   default=list(ADAPTER_TARGETS),
                   help="gated-lora: the projections that get an update (default: all)")
    c = t.add_argument_group("checkpoints")
    c.add_argument("--out", required=True,
                   help="output folder: checkpoints/, log.jsonl, final/ (the exported model)")
    c.add_argument("--save-every", type=positive_int, default=1000,
                   help="checkpoint every N steps")
    c.add_argument("--keep", type=positive_int, default=2, help="checkpoints to keep")
    # One or neither.
    x = c.add_mutually_exclusive_group()
    x.add_argument("--resume", action="store_true",
                   help="continue from --out's last checkpoint")
    x.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    c.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute block activations in backward")
    c.add_argument("--log-every", type=positive_int, default=1,
                   help="log.jsonl row every N steps")

    e = sub.add_parser("eval", help="GSM8K sweep over static k and ConfAdapt thresholds")
    common(e, " (a tuned model, or any for k = 1)", 256)
    e.add_argument("--data", required=True, help="GSM8K test JSONL (question, answer)")
    e.add_argument("--out", default="runs/gsm8k_eval",
                   help="folder for results.json/.md, pareto.png, samples.jsonl")
    e.add_argument("--overwrite", action="store_true",
                   help="replace an earlier eval's files in --out")
    e.add_argument("--prompt-style", default="fewshot", choices=("fewshot", "zeroshot"),
                   help="fewshot: lm-eval gsm8k_cot; zeroshot: the question in the training "
                   "format (small models)")
    e.add_argument("--n-shot", type=number(int, 0, 8), default=8,
                   help="fewshot: exemplars before the question")
    e.add_argument("--static-k", type=positive_int, nargs="*", default=[1, 2, 3, 4],
                   help="static k values (1: greedy)")
    e.add_argument("--taus", type=probability, nargs="*", default=taus,
                   help="ConfAdapt thresholds, each in (0, 1]")
    e.add_argument("--k-max", type=positive_int, default=16,
                   help="ConfAdapt: most tokens per pass")
    e.add_argument("--lossless-k", type=count, default=0,
                   help="also run the lossless mode with this k (0: no)")
    e.add_argument("--limit", type=count, default=0, help="first N questions only (0: all)")
    e.add_argument("--reference",
                   help="an earlier eval's --out: report how often each answer equals its "
                   "k=1 answer")

    a = sub.add_parser("analyze",
                       help="before tuning: how predictable are the model's answers on this "
                       "domain?")
    common(a, ": the base model, before tuning", 256)
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="the domain's prompts: rows with question, query or prompt")
    src.add_argument("--domains", nargs="+", choices=DOMAINS,
                     help="held-out prompts generated in code, per domain")
    a.add_argument("--limit", type=count, default=64, help="first N prompts only (0: all)")
    a.add_argument("--taus", type=probability, nargs="+", default=taus,
                   help="ConfAdapt thresholds, each in (0, 1]")
    a.add_argument("--k-max", type=number(int, 2), default=16, help="most tokens per pass")
    a.add_argument("--out", help="also write analysis.json and analysis.md here")
    a.add_argument("--overwrite", action="store_true",
                   help="replace an earlier analysis in --out")

    r = sub.add_parser("data",
                       help="training rows from the model itself: its greedy answers to "
                       "domain prompts")
    common(r, "", 128)
    r.add_argument("--out", required=True,
                   help="JSONL file of {domain, prompt, response} rows (train --data takes "
                   "it)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    r.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS),
                   help="domains")
    r.add_argument("--per-domain", type=positive_int, default=100,
                   help="prompts per domain (fewer if it has fewer)")
    r.add_argument("--split", default="train", choices=("train", "test"),
                   help="prompt split")

    x = sub.add_parser("export", help="a training checkpoint -> a Hugging Face folder")
    x.add_argument("--checkpoint", required=True,
                   help="a run's --out folder or one checkpoints/step_N folder")
    x.add_argument("--out", required=True,
                   help="the Hugging Face folder to write: new or empty")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out")
    x.add_argument("--threads", type=positive_int, help="CPU threads (default: one per core)")
    return p


def check_args(args):
    """Before any work: what a command reads exists, what it writes can be made;
    train's sizes."""
    # export has --checkpoint, no --model or --data.
    a = vars(args)
    for flag in ("model", "checkpoint"):
        if a.get(flag) is not None:
            input_path(a[flag], f"--{flag}", folder=True)
    # The model's config says most about a wrong folder.
    cfg = read_model_config(base_folder(args.model)) if "model" in a else None
    # One file (eval, analyze) or several (train).
    data = a.get("data")
    if isinstance(data, str):
        data = [data]
    for path in data or []:
        input_path(path, "--data")
    # An earlier eval's --out.
    if a.get("reference") is not None:
        input_path(os.path.join(args.reference, "samples.jsonl"), "--reference")
    # data's --out is a file.
    if args.command == "data":
        if os.path.isdir(args.out):
            raise CliError(f"--out {args.out}: is a folder, expected a file name")
        output_folder(os.path.dirname(args.out) or ".", f"--out {args.out}: its folder")
        if os.path.exists(args.out) and not args.overwrite:
            raise CliError(f"--out {args.out} exists: add --overwrite to replace it")
    elif a.get("out") is not None:
        output_folder(args.out, "--out")
        check_out_folder(args)
    if args.command != "train":
        return

    used = [f for f in ("checkpoints", "log.jsonl", "final") if (Path(args.out) / f).exists()]
    if used and not (args.resume or args.overwrite):
        raise CliError(f"--out {args.out} already holds a training run ({used[0]}): add "
                       "--resume to continue it, or --overwrite to replace it")
    if args.seq_len + args.k_max - 2 >= cfg.max_seq_len:
        raise CliError(f"--seq-len {args.seq_len} with --k-max {args.k_max} needs positions "
                       f"up to {args.seq_len + args.k_max - 2}; the model supports "
                       f"{cfg.max_seq_len}")
    if args.adapter != "none" and args.prefix_ntp_weight > 0:
        raise CliError("--prefix-ntp-weight trains the next-token predictions, which the "
                       "gated adapter cannot change (it acts only at <mask> positions): "
                       "leave it at 0")
    if base_folder(args.model) != args.model:
        raise CliError(f"--model {args.model} is a gated mask adapter: train from its base "
                       f"model ({base_folder(args.model)})")
    if args.regions is not None and args.regions > args.seq_len:
        raise CliError(f"--regions {args.regions}: at most --seq-len ({args.seq_len}) "
                       "regions fit in a sequence")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % (world * args.micro_batch):
        raise CliError(f"--batch-size {args.batch_size} must be a multiple of --micro-batch "
                       f"{args.micro_batch} x {world} processes")
    if args.warmup > args.steps // 2:
        reached = min(1.0, args.steps / max(1, args.warmup))
        if reached < 1:
            how = f"only reaches {100 * reached:.2g}% of --lr {args.lr:g}"
        else:
            how = f"reaches --lr {args.lr:g} only at step {args.warmup}"
        print(f"warning: --warmup {args.warmup} is over half of --steps {args.steps}: the "
              f"learning rate {how}", flush=True)


# What each command writes into its --out folder; a folder holding anything
# else is not its own.
WRITES = {"eval": ("results.json", "results.md", "pareto.png", "samples.jsonl"),
          "analyze": ("analysis.json", "analysis.md")}


def check_out_folder(args):
    """eval, analyze and export write into a new or empty folder, or
    (--overwrite) over their own earlier output; never into a model folder or a
    training run they did not write."""
    out = Path(args.out)
    if args.command == "train" or not out.is_dir() or not any(out.iterdir()):
        return
    if any((out / f).exists() for f in ("checkpoints", "log.jsonl", "train_args.json")):
        raise CliError(f"--out {out} holds a training run: write into a new folder")
    if args.command == "export":
        card = out / "README.md"
        ours = card.is_file() and MODEL_CARD_TAGS in card.read_text(encoding="utf-8",
                                                                     errors="replace")
        if not ours:
            what = "a model" if (out / "config.json").exists() else "files"
            raise CliError(f"--out {out} holds {what} that export did not write: export "
                           "into a new or empty folder")
    else:
        foreign = sorted(p.name for p in out.iterdir() if p.name not in WRITES[args.command])
        if foreign:
            raise CliError(f"--out {out} holds files {args.command} does not write "
                           f"({', '.join(foreign[:3])}): write into a new or empty folder")
    if not args.overwrite:
        raise CliError(f"--out {out} holds an earlier {args.command}'s output: add "
                       "--overwrite to replace it")


COMMANDS = {"train": train, "eval": evaluate, "analyze": analyze, "data": make_data,
            "export": export_checkpoint}


def command(argv):
    args = build_parser().parse_args(argv)
    # Checkpoints (torch.distributed.checkpoint) warn about this on one process.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        check_args(args)
        COMMANDS[args.command](args)
    finally:
        if "WORLD_SIZE" in os.environ and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    return run_cli(command, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
