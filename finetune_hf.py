"""Fine-tune a Hugging Face Llama/Qwen/SmolLM2 checkpoint into a multi-token predictor.

`train` reads a checkpoint, adds one token, <mask>, and self-distills the model
against a frozen copy of itself: each step lays its rows out as k-token problems
(data.mtp_layout), scores the student's predictions against the teacher's
(distill.mtp_loss) and steps AdamW. Checkpoints make a run resumable bit for bit;
it ends in a Hugging Face folder with <mask> in it (`export` writes one from any
checkpoint). The same loop runs on one process or, under torchrun, sharded with
FSDP2 (mtp/distributed.py).

The other commands measure and feed it: `eval` scores GSM8K as
lm-evaluation-harness's gsm8k_cot over static k and ConfAdapt thresholds
(tasks/gsm8k.py); `analyze` estimates before tuning what ConfAdapt could reach on
a domain (mtp/analyze.py); `data` writes a model's own answers as training rows
(mtp/training_rows.py); `calibrate` fits a gated adapter's confidences on held-out
rows (mtp/calibration.py). The flags and the checks made before any work:
mtp/finetune_cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from adapter import add_mask_adapter, gated_mtp_loss, save_mask_adapter
from data import default_n_regions, mtp_layout, sample_k_and_offset
from distill import frozen_teacher, mtp_loss, read_stats
from model import Transformer, add_mask_token
from mtp.analyze import analyze
from mtp.calibration import calibrate
from mtp.cli import Progress, format_seconds, input_path, load_tokenizer, read_checkpoint
from mtp.distributed import (ABSENT, Dist, average_gradients, check_same_run, latest_checkpoint,
                             load_shards, replicate_from_rank0, setup_processes, shard_base,
                             shard_from_rank0, training_state_bytes)
from mtp.finetune_cli import MODEL_CARD_TAGS, run_commands
from mtp.folders import TRAINED_WITH
from mtp.hf import atomic_save, from_pretrained, read_json, save_pretrained, write_json
from mtp.tokenizer import Tokenizer, default_format, padding_token, training_sequences
from mtp.training_rows import check_targets, make_data, training_pairs
from tasks.gsm8k import evaluate


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
    # What --format auto and an unset --regions leave open is settled here, in a
    # copy of the arguments: checkpoints, train_args.json and the model card
    # record the values the run uses.
    fmt = args.format
    if fmt == "auto":
        fmt = default_format(tok, student.config.model_type)
    regions = args.regions or default_n_regions(args.seq_len, args.k_max)
    args = argparse.Namespace(**(vars(args) | {"format": fmt, "regions": regions}))
    pad = padding_token(tok, args.format)
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
    where = f"over {dist.world}" if dist.sharded else f"on each of {dist.world}"
    dist.log(f"training state: {sum(state.values()) / 2**30:.2f} GB {where} "
             f"process(es) ({parts})")
    dist.log(f"{args.mode} training: {len(pairs):,} rows, format {args.format}, "
             f"{args.steps:,} steps of {args.batch_size} sequences of {args.seq_len} "
             f"tokens, {dist.world} process(es) on {dist.device}, {micro_batches} "
             f"micro-batch(es) of {args.micro_batch} each")

    sequences = args.steps * args.batch_size
    if dist.device.type == "cpu" and sequences >= 1_000_000:
        dist.log(f"note: that is {sequences:,} sequences, the scale of the paper's multi-GPU "
                 "recipe (the defaults); the first progress line, after step 1, says how "
                 "long a step takes here and what the run will cost. A CPU-sized run: the CPU "
                 "walk-through in docs/finetuning.md")

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


# Precision. The student keeps float32 master weights (lr 1e-5 updates vanish in
# bfloat16's 8-bit mantissa), computing in --dtype (FSDP2's MixedPrecisionPolicy
# when sharded, else torch.autocast); the teacher never changes, so it is stored
# in the compute dtype. Sharding. Every rank builds both models on the meta
# device (no memory), shards each block (one all-gather unit), then the root;
# rank 0 alone reads the checkpoint, broadcasting its weights straight into
# every process's shards (mtp.distributed.shard_from_rank0).
def load_student_and_teacher(args, dist: Dist, with_teacher: bool = True):
    """(student, teacher or None, tokenizer, mask id) on dist.device, sharded
    when dist.sharded. With the gated adapter the base is frozen and there is no
    teacher to build: it is the student with its adapter off (gated_mtp_loss)."""
    tok = load_tokenizer(args.model)
    full = None
    meta = [None]
    # Rank 0 reads the checkpoint in float32 and adds <mask>: the first spare row
    # of the embedding (and output) matrix, or a new one, drawn like a typical
    # token (model.add_mask_token).
    if dist.main:
        full = from_pretrained(args.model, dtype=torch.float32)
        meta = [(full.config, add_mask_token(full, tok))]
    # Rank 0's config and mask id on every rank (its tokenizer has <mask>).
    if dist.group:
        torch.distributed.broadcast_object_list(meta, src=0)
    cfg, mask_id = meta[0]
    tok.add_special_token("<mask>", mask_id)
    adapter = uses_adapter(args)
    settings = None
    if adapter:
        settings = adapter_settings(args)

    # Under torchrun: rank 0's weights broadcast into every process's shards or,
    # for the gated adapter where its base fits (--shard-base), into a whole copy
    # on each.
    if dist.group and adapter:
        dist.sharded = shard_base(getattr(args, "shard_base", "auto"), cfg, args, dist)
    if dist.sharded:
        student, teacher = shard_from_rank0(full, cfg, dist, settings, with_teacher)
        return student.train(), teacher, tok, mask_id
    if dist.group:
        student = replicate_from_rank0(full, cfg, dist, settings)
        return student.train(), None, tok, mask_id
    # One process. With the adapter, the frozen base is in the compute dtype,
    # like a teacher copy, and the adapter in float32.
    if adapter:
        full.to(device=dist.device, dtype=dist.dtype)
        add_mask_adapter(full, *settings)
        return full.train(), None, tok, mask_id
    # Without it, a teacher copy is made on the CPU, then moved.
    teacher = None
    if with_teacher:
        teacher = frozen_teacher(full).to(device=dist.device, dtype=dist.dtype)
    return full.to(dist.device).train(), teacher, tok, mask_id


def adapter_settings(args) -> tuple:
    """add_mask_adapter's rank, alpha, targets and slots (k_max - 1 slot
    embeddings with --adapter-slot-embeddings, else one shared)."""
    slots = args.k_max - 1 if args.adapter_slot_embeddings else 0
    return args.adapter_rank, args.adapter_alpha, args.adapter_targets, slots


def uses_adapter(args) -> bool:
    """Whether the run trains a gated mask adapter (--adapter gated-lora) rather
    than every weight. `args` may be a checkpoint's saved arguments, which need
    not name the flag: then it trains none."""
    return getattr(args, "adapter", "none") != "none"


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
    # over it however it is split (the processes average their gradients: hence
    # * world). They are counted on the host, before moving.
    counts = [int(b.valid.sum()) for b in batches]
    batches = [b.to(dist.device) for b in batches]
    n_global = max(1.0, dist.all_sum(sum(counts)))

    # 3. Loss and backward, per micro-batch, the statistics left on the device
    # until all have run. Sharded, each backward reduce-scatters at once (no
    # full gradient is held) and FSDP2's MixedPrecisionPolicy casts; else
    # autocast does.
    autocast = torch.autocast(dist.device.type, dtype=dist.dtype,
                              enabled=dist.dtype != torch.float32 and not dist.sharded)
    unread = []
    for batch, n in zip(batches, counts):
        with autocast:
            if uses_adapter(args):
                # mtp_loss with the student's adapter switched off as teacher,
                # computing the base model's ground-truth rows once, without
                # gradient
                loss, stats = gated_mtp_loss(student, batch, mode=args.mode, host=False)
            else:
                loss, stats = mtp_loss(student, teacher, batch, mode=args.mode,
                                       prefix_ntp_weight=args.prefix_ntp_weight, host=False)
        (loss * (n / n_global) * dist.world).backward()
        unread.append(stats)
    # A replicated model (the gated adapter's, unsharded): its gradients
    # averaged over the processes, in one all-reduce.
    if dist.group and not dist.sharded:
        average_gradients(student, dist)

    loss_sum = 0.0
    agree = 0.0
    for stats, n in zip(read_stats(unread), counts):
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


def rows_of_step(step: int, global_batch: int, n_rows: int, seed: int) -> list[int]:
    """Row indices of the global batch of step `step` (0-based): a seeded
    permutation per epoch."""
    first = step * global_batch
    epochs = range(first // n_rows, (first + global_batch - 1) // n_rows + 1)
    order = torch.cat([
        torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
        for e in epochs])
    return order[first - epochs[0] * n_rows:][:global_batch].tolist()


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


# A checkpoint is checkpoints/step_000123/: torch.distributed.checkpoint's files
# (each process its shards of model and optimizer state) and trainer.pt (step,
# scheduler, CPU RNG, arguments), renamed from a temporary name when complete,
# then named in `latest`: a crash leaves the last one whole.
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


def load_checkpoint(path: Path, student, optimizer, scheduler, args):
    """Restore model, optimizer, scheduler and RNG from `path` if the run's
    settings match -> (steps done, the --steps that run was asked for)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    trainer = read_checkpoint(path / "trainer.pt", "training checkpoint", weights_only=True)
    check_same_run(trainer["args"], vars(args), path)
    state, options = checkpoint_state(student, optimizer, args)
    load_shards(state, path)
    set_state_dict(student, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(trainer["scheduler"])
    # Per-GPU states, where saved, are unused.
    torch.set_rng_state(trainer["rng_cpu"])
    return trainer["step"], trainer["args"]["steps"]


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
                add_mask_adapter(model, *adapter_settings(args))
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
        # what decoding it defaults to (mtp.folders.apply_trained_with)
        write_json(path / TRAINED_WITH, {"k_max": args.k_max, "format": args.format})

    dist.barrier()
    dist.log(f"exported {path}")
    return path


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
    # a setting newer than the run has the value the run trained with: its default
    saved = argparse.Namespace(**(ABSENT | trainer["args"]))
    input_path(saved.model, "the base model this checkpoint was tuned from", folder=True)
    student, _, tok, _ = load_student_and_teacher(saved, Dist(), with_teacher=False)
    # Optimizer and scheduler are unused, but load_checkpoint restores them.
    opt = student.configure_optimizer(
        saved.lr, saved.weight_decay, (saved.beta1, saved.beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    load_checkpoint(ckpt, student, opt, scheduler, saved)
    return export(student, tok, Path(args.out), saved, Dist())


def main(argv=None) -> int:
    """`python finetune_hf.py COMMAND ...`: mtp.finetune_cli parses and checks the
    flags, then runs the command."""
    commands = {"train": train, "eval": evaluate, "analyze": analyze, "data": make_data,
                "calibrate": calibrate, "export": export_checkpoint}
    return run_commands(commands, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
