"""The whole method on a CPU in minutes: NTP teacher -> naive vs distilled MTP -> evaluation -> plots.

    python train_toy.py                      full run (7-10 minutes on 2 CPU cores)
    python train_toy.py --quick              smoke test (about 12 seconds)
    python train_toy.py --export-hf hf_toy   also save teacher and student in Hugging Face layout
    python train_toy.py --word-problems runs/wp   phase 1 only, on word problems: the base model
                                             of finetune_hf.py's miniature (see the end of this file)

What happens (data.py describes the four toy tasks, two of which have branch points):

  1. teacher   a small Llama-style transformer trained from scratch with next-token prediction.
  2. students  two copies of the teacher, each given a `<mask>` token (model.add_mask_token) and
               trained for multi-token prediction with the same data, steps and learning rate:
                 naive    cross-entropy against the ground-truth next k tokens   (mode "gt")
                 distill  student-forced self-distillation from the frozen teacher (mode "hard")
               Every step draws k in [2, k_max] and the region offset independently and packs
               the batch with data.mtp_layout (METHOD.md sections 3-4).
  3. evaluate  teacher, naive and distilled on held-out prompts (parameters never trained on):
               static k = 1..k_max, ConfAdapt over a sweep of thresholds tau, and the lossless
               mode, all through confadapt.generate with its KV cache. Per (model, decoding,
               task): accuracy, coherence, degeneration rate, effective k (tokens per forward
               pass), tokens/second.
  4. report    OUT/results.json and plots: accuracy and coherence against effective k (the
               speed/quality picture), training curves, the training attention mask, and one
               generation drawn as coloured chunks, one chunk per forward pass.

Each phase checkpoints OUT/checkpoints/<phase>.pt atomically; running again with the same
settings skips finished phases (--restart retrains everything).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

import data
from confadapt import DecodeConfig, chunk_texts, generate, save_chunks_png
from distill import frozen_teacher, mtp_loss
from model import ModelConfig, Transformer, add_mask_token, atomic_save, parse_device

MODELS = ("ntp", "naive", "distill")          # names used in results.json
STUDENT_MODE = {"naive": "gt", "distill": "hard"}


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------

@dataclass
class RunConfig:
    # model
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    ffn_dim: int = 384
    # data
    tasks: tuple = data.TOY_TASKS      # drawn uniformly
    seq_len: int = 21                  # every toy sequence fits (the longest, repeat, is 21 tokens)
    # phase 1: teacher (next-token prediction)
    batch_size: int = 32
    teacher_steps: int = 3000          # the budget is near its floor: fewer steps failed a seed (README)
    teacher_lr: float = 4e-3
    # phase 2: students (multi-token prediction), the same budget for both
    mtp_batch_size: int = 16
    mtp_steps: int = 700               # an MTP step costs 3-4x a teacher step
    mtp_lr: float = 2e-3
    k_max: int = 8
    n_regions: int = 21                # = seq_len: every token ends a region (paper: N / (2 k_max), 1 here)
    prefix_ntp_weight: float = 1.0     # next-token loss on the ground-truth answer tokens too
    warmup_steps: int = 20
    weight_decay: float = 0.1
    # phase 3: evaluation
    n_eval: int = 200                  # held-out prompts per task, at most (count 84, count_free 27)
    static_ks: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    taus: tuple = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
    max_new_tokens: int = 24           # answers are at most 13 items + <|eos|>
    seed: int = 0

    def phase_key(self, phase: str, data_id: str = "") -> dict:
        """The settings a phase's checkpoint depends on, and its data (`data_fingerprint`); a
        mismatch means: train again."""
        shared = ["dim", "n_layers", "n_heads", "ffn_dim", "tasks", "seq_len", "batch_size", "teacher_steps",
                  "teacher_lr", "seed"]
        if phase in STUDENT_MODE:
            shared += ["mtp_batch_size", "mtp_steps", "mtp_lr", "k_max", "n_regions", "prefix_ntp_weight",
                       "warmup_steps", "weight_decay"]
        return {**{name: getattr(self, name) for name in shared}, "data": data_id}


QUICK = dict(dim=64, n_layers=2, ffn_dim=192, batch_size=16, teacher_steps=40, mtp_batch_size=8, mtp_steps=20,
             warmup_steps=5, n_eval=6, static_ks=(1, 4), taus=(0.5, 0.9), max_new_tokens=16)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def ntp_loss(model, seqs: torch.Tensor, answer: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Next-token cross-entropy on the answer tokens (the prompts are random: nothing to learn there)."""
    logits = model(seqs[:, :-1]).float()                                    # (B, N-1, V)
    targets = seqs[:, 1:].masked_fill(~answer[:, 1:], -100)                 # (B, N-1) ignore prompt and padding
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return loss, {"loss": float(loss.detach())}


def format_seconds(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def train_phase(name: str, model, loss_fn, steps: int, lr: float, batch_size: int, cfg: RunConfig, next_batch,
                device, log_every: int = 1) -> list[dict]:
    """AdamW over fresh batches `next_batch(rng, batch_size) -> (seqs, answer)`, the data stream
    depending only on the seed; returns the log."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), foreach=True)
    rng = random.Random(cfg.seed + 1)                    # the same batches for every student
    gen = torch.Generator().manual_seed(cfg.seed + 2)    # the same k / offset draws too
    model.train()
    log, start = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr, cfg.warmup_steps)
        seqs, answer = next_batch(rng, batch_size)                                           # (B, N) each
        loss, stats = loss_fn(model, seqs.to(device), answer.to(device), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        elapsed = time.perf_counter() - start
        stats.update(step=step, seconds=elapsed, lr=opt.param_groups[0]["lr"])
        log.append(stats)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            tok_s = (step + 1) * seqs.numel() / elapsed
            eta = elapsed / (step + 1) * (steps - step - 1)
            extra = f" k {stats['k']}" if "k" in stats else ""
            print(f"[{name}] step {step + 1:4d}/{steps} | loss {stats['loss']:.4f}{extra} | "
                  f"{tok_s:,.0f} tok/s | elapsed {format_seconds(elapsed)} | eta {format_seconds(eta)}", flush=True)
    model.eval()
    return log


def teacher_loss_fn():
    return lambda model, seqs, answer, gen: ntp_loss(model, seqs, answer)


def supervise_answers_only(batch: data.MTPBatch, answer: torch.Tensor) -> data.MTPBatch:
    """Drop the predictions whose target is a prompt token: prompts are random, as for the teacher."""
    k = batch.valid.shape[-1]
    target_index = batch.prefix_end[:, None] + 1 + torch.arange(k, device=answer.device)   # (M, k) original index
    answer_start = answer.long().argmax(1)                                                 # (B,) first answer token
    batch.valid = batch.valid & (target_index[None] >= answer_start[:, None, None])        # (B, M, k)
    batch.ntp_valid = batch.ntp_valid & answer[:, 1:]                                      # (B, N-1)
    return batch


def student_loss_fn(teacher, mode: str, cfg: RunConfig, tokenizer):
    """mtp_loss on a freshly drawn layout: k in [2, k_max] and the offset, independently."""
    def loss_fn(model, seqs, answer, gen):
        batch = data.random_mtp_layout(seqs, cfg.k_max, tokenizer.mask_id, tokenizer.eos_id, tokenizer.pad_id,
                                       n_regions=cfg.n_regions, generator=gen)
        return mtp_loss(model, teacher, supervise_answers_only(batch, answer), mode=mode,
                        prefix_ntp_weight=cfg.prefix_ntp_weight)
    return loss_fn


# ----------------------------------------------------------------------------------------------
# Checkpoints: one file per phase, written atomically, so an interrupted run resumes
# ----------------------------------------------------------------------------------------------

def save_checkpoint(path: str, model, log: list[dict], seconds: float, key: dict):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ckpt = {"model_config": asdict(model.config), "state": model.state_dict(), "log": log, "seconds": seconds,
            "key": key}
    atomic_save(lambda tmp: torch.save(ckpt, tmp), path)   # a crash leaves the old file or the new, never half


def load_checkpoint(path: str, key: dict, device):
    """(model, log, seconds) if `path` holds a finished phase trained with these settings, else None."""
    if not os.path.exists(path):
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt["key"] != key:
        print(f"  {path} was trained with other settings: training again")
        return None
    model = Transformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["state"])
    return model.to(device).eval(), ckpt["log"], ckpt["seconds"]


def toy_batches(cfg: RunConfig, tokenizer):
    """The toy phases' batch function: (rng, batch_size) -> (seqs, answer), tasks mixed uniformly."""
    return lambda rng, batch_size: data.toy_batch(tokenizer, rng, batch_size, cfg.tasks, cfg.seq_len)


def data_fingerprint(tokenizer, next_batch, seed: int) -> str:
    """What a phase trains on, in one string: the vocabulary size and a checksum of 256 sequences
    from the phase's batch function, so that a changed tokenizer or task generator retrains."""
    seqs, answer = next_batch(random.Random(seed), 256)
    return f"vocab {tokenizer.n_vocab}, crc {zlib.crc32(seqs.numpy().tobytes() + answer.numpy().tobytes())}"


def run_phase(name, out, cfg, restart, device, train, data_id: str = ""):
    """Load the phase's checkpoint if it is there and matches (settings and `data_id`), else call
    train() and save."""
    path = os.path.join(out, "checkpoints", f"{name}.pt")
    key = cfg.phase_key(name, data_id)
    found = None if restart else load_checkpoint(path, key, device)
    if found is not None:
        print(f"== {name}: loaded {path} (trained in {found[2]:.0f} s; --restart to retrain)")
        return found
    print(f"== {name}: training")
    start = time.perf_counter()
    model, log = train()
    seconds = time.perf_counter() - start
    save_checkpoint(path, model, log, seconds, key)
    return model, log, seconds


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

def decodings(cfg: RunConfig, multi_token: bool) -> list[tuple[str, DecodeConfig]]:
    """The decoding settings to sweep; a model without <mask> only decodes one token per pass."""
    if not multi_token:
        return [("static", DecodeConfig("static", k=1))]
    out = [("static", DecodeConfig("static", k=k)) for k in cfg.static_ks]
    out += [("confadapt", DecodeConfig("confadapt", tau=tau, k_max=cfg.k_max)) for tau in cfg.taus]
    out.append(("lossless", DecodeConfig("lossless", k=cfg.k_max)))
    return out


def answer_text(tokenizer, tokens: list[int]) -> tuple[str, bool]:
    """(generated text before <|eos|>, whether <|eos|> was produced)."""
    if tokenizer.eos_id in tokens:
        return tokenizer.decode(tokens[: tokens.index(tokenizer.eos_id)]), True
    return tokenizer.decode(tokens), False


def evaluate(name: str, model, tokenizer, eval_sets: dict, cfg: RunConfig) -> tuple[list[dict], dict]:
    """One results row per (decoding, task), plus a few sample outputs for the log."""
    rows, samples = [], {}
    for decode, mode in decodings(cfg, model.config.mask_token_id is not None):
        for task, examples in eval_sets.items():
            prompts = [data.encode_example(tokenizer, ex)[0] for ex in examples]
            gens, stats = generate(model, prompts, cfg.max_new_tokens, mode=mode, stop_ids=[tokenizer.eos_id])
            scores = [data.check_toy(task, ex.key, *answer_text(tokenizer, g.tokens)) for ex, g in zip(examples, gens)]
            n = len(scores)
            rows.append({
                "model": name, "decode": decode,
                "k": mode.k_max if decode == "confadapt" else mode.k,
                "tau": mode.tau if decode == "confadapt" else None,
                "task": task,
                "accuracy": sum(s.accuracy for s in scores) / n,
                "coherence": sum(s.coherence for s in scores) / n,
                "degeneration": sum(s.degenerate for s in scores) / n,
                "effective_k": stats.effective_k,
                "tokens_per_s": stats.tokens_per_second,
                "forward_passes": stats.row_passes / n,          # per prompt, on average
                "batch_forward_passes": stats.forward_passes,    # batched calls for all n prompts
                "n_prompts": n,
            })
            samples[f"{task} | {mode.describe()}"] = examples[0].prompt + answer_text(tokenizer, gens[0].tokens)[0]
    return rows, samples


def cell(rows, **match) -> dict | None:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return found[0] if found else None


def acceptance(rows: list[dict]) -> dict:
    """The figures the toy is meant to show (see the README), read off the results rows."""
    out = {}
    for task in data.BRANCHING_TASKS:
        naive = cell(rows, model="naive", decode="static", k=4, task=task)
        dist = cell(rows, model="distill", decode="static", k=4, task=task)
        if naive and dist:
            out[f"{task}_static4"] = {"naive_coherence": naive["coherence"], "distill_coherence": dist["coherence"],
                                      "naive_degeneration": naive["degeneration"],
                                      "distill_degeneration": dist["degeneration"]}
    for task in ("count", "repeat"):
        teacher = cell(rows, model="ntp", decode="static", k=1, task=task)
        dist = cell(rows, model="distill", decode="confadapt", tau=0.9, task=task)
        if teacher and dist:
            out[f"{task}_confadapt0.9"] = {"teacher_k1_accuracy": teacher["accuracy"],
                                          "distill_accuracy": dist["accuracy"], "distill_effective_k": dist["effective_k"]}
    return out


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------

STYLE = {"ntp": ("black", "*"), "naive": ("tab:red", "o"), "distill": ("tab:blue", "s")}


def plot_pareto(rows: list[dict], path: str):
    """Accuracy and coherence against effective k, one column per task: static k (solid),
    ConfAdapt's tau sweep (dashed), lossless (hollow marker), the teacher at k = 1 (star)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows}, key=data.TOY_TASKS.index)
    fig, axes = plt.subplots(2, len(tasks), figsize=(4 * len(tasks), 7), squeeze=False)
    for col, task in enumerate(tasks):
        for row, metric in enumerate(("accuracy", "coherence")):
            ax = axes[row][col]
            for name in MODELS:
                colour, marker = STYLE[name]
                for decode, line in (("static", "-"), ("confadapt", "--")):
                    cells = [r for r in rows if r["model"] == name and r["task"] == task and r["decode"] == decode]
                    cells.sort(key=lambda r: r["k"] if decode == "static" else -r["tau"])   # in sweep order
                    pts = [(r["effective_k"], r[metric]) for r in cells]
                    if pts:
                        ax.plot(*zip(*pts), line, color=colour, marker=marker, ms=4 if name != "ntp" else 12,
                                label=f"{name} {decode}")
                for r in rows:
                    if r["model"] == name and r["task"] == task and r["decode"] == "lossless":
                        ax.plot(r["effective_k"], r[metric], marker="D", mfc="none", color=colour, ms=8,
                                ls="none", label=f"{name} lossless")
            ax.set_title(f"{task}{' (branching)' if task in data.BRANCHING_TASKS else ''}")
            ax.set_xlabel("effective k (tokens per forward pass)")
            ax.set_ylabel(metric)
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("held-out prompts: quality against tokens per forward pass")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(logs: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    teacher = logs["teacher"]
    axes[0].plot([s["step"] for s in teacher], [s["loss"] for s in teacher], color="black", lw=0.8)
    axes[0].set_title("teacher: next-token cross-entropy")
    for name in ("naive", "distill"):
        log = logs[name]
        axes[1].plot([s["step"] for s in log], [s["loss"] for s in log], color=STYLE[name][0], lw=0.8,
                     label=f"{name} ({STUDENT_MODE[name]})")
    axes[1].set_title("students: MTP loss (distill: relative to the teacher)")
    axes[1].legend()
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_examples(model, tokenizer, cfg: RunConfig, out: str):
    """The training attention mask, and a ConfAdapt generation drawn one chunk per forward pass."""
    rng = random.Random(cfg.seed)
    seqs, _ = data.toy_batch(tokenizer, rng, 1, tasks=("count",), seq_len=cfg.seq_len)
    batch = data.mtp_layout(seqs, k=4, offset=5, n_regions=2, mask_id=tokenizer.mask_id,    # 2 regions: readable
                            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    data.plot_attention_mask(batch, os.path.join(out, "attention_mask.png"),
                             token_str=lambda t: tokenizer.decode([t]).strip())
    example = data.heldout_examples("count", 1)[0]
    prompt = data.encode_example(tokenizer, example)[0]
    device = next(model.parameters()).device
    mode = DecodeConfig("confadapt", tau=0.9, k_max=cfg.k_max)
    gens, _ = generate(model.to(device), [prompt], cfg.max_new_tokens, mode=mode, stop_ids=[tokenizer.eos_id])
    g = gens[0]
    save_chunks_png(os.path.join(out, "chunks.png"), example.prompt, chunk_texts(tokenizer, g.tokens, g.chunk_sizes),
                    g.chunk_sizes, title=f"distilled student, {mode.describe()}: {len(g.tokens)} tokens in "
                                         f"{g.forward_passes} forward passes")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def build_teacher(cfg: RunConfig, tokenizer, device, tie_embeddings: bool = True, context: int = 128) -> Transformer:
    torch.manual_seed(cfg.seed)
    mcfg = ModelConfig(vocab_size=tokenizer.n_vocab, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       n_kv_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim, max_seq_len=context, tie_embeddings=tie_embeddings,
                       bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    return Transformer(mcfg).to(device)


def student_from(teacher: Transformer, device) -> tuple[Transformer, object]:
    """A trainable copy of the teacher with <mask> added, and the tokenizer that knows <mask>."""
    tokenizer = data.toy_tokenizer()
    student = Transformer(replace(teacher.config))
    student.load_state_dict(teacher.state_dict())
    add_mask_token(student, tokenizer)
    return student.to(device), tokenizer


def export_hf(path: str, teacher, student):
    """DIR/teacher and DIR/student in Hugging Face layout, each with its tokenizer."""
    teacher.save_pretrained(os.path.join(path, "teacher"))
    data.toy_tokenizer().save_pretrained(os.path.join(path, "teacher"))
    student.save_pretrained(os.path.join(path, "student"))
    _, tokenizer = student_from(teacher, "cpu")
    tokenizer.save_pretrained(os.path.join(path, "student"))
    print(f"exported {path}/teacher and {path}/student (Hugging Face layout)")


# ----------------------------------------------------------------------------------------------
# The miniature's base model (README, "Miniature reproduction"): what finetune_hf.py tunes
# ----------------------------------------------------------------------------------------------
#
# `--word-problems DIR` runs phase 1 alone on other data: it writes the synthetic grade-school
# word problems (data.py, "Word problems") to DIR/data, trains a small Llama-layout model on
# them from scratch by next-token prediction (question and solution both) and saves it to
# DIR/base in Hugging Face layout with its tokenizer: a stand-in for a downloaded pretrained
# checkpoint, which finetune_hf.py then tunes by self-distillation.

WORD_PROBLEMS = dict(dim=128, n_layers=4, n_heads=4, ffn_dim=512, seq_len=64, batch_size=32, teacher_steps=1500,
                     teacher_lr=2e-3, warmup_steps=100, tasks=("word_problems",))
WORD_PROBLEMS_QUICK = dict(dim=32, n_layers=1, n_heads=2, ffn_dim=64, batch_size=4, teacher_steps=3, warmup_steps=1)
WORD_PROBLEM_CONTEXT = 512          # positions the base model supports: room for few-shot prompts


def word_problem_base_model(args, device) -> dict:
    cfg = replace(RunConfig(seed=args.seed), **{**WORD_PROBLEMS, **(WORD_PROBLEMS_QUICK if args.quick else {})})
    if args.teacher_steps is not None:
        cfg = replace(cfg, teacher_steps=args.teacher_steps)
    folder = args.word_problems
    start = time.perf_counter()
    train_file, test_file = data.write_word_problems(os.path.join(folder, "data"), n_train=200 if args.quick else 20_000,
                                                     n_test=10 if args.quick else 500, seed=args.seed)
    pairs = data.word_problem_pairs(train_file)
    tokenizer = data.word_problem_tokenizer()
    print(f"wrote {train_file} ({len(pairs)} MetaMathQA-format rows) and {test_file} (GSM8K-format rows)")

    def batches(rng, batch_size):
        return data.word_problem_batch(tokenizer, pairs, rng, batch_size, cfg.seq_len)

    def train():
        model = build_teacher(cfg, tokenizer, device, tie_embeddings=False, context=WORD_PROBLEM_CONTEXT)
        print(f"  base model: {model.num_params() / 1e6:.2f}M parameters, vocabulary {tokenizer.n_vocab}")
        return model, train_phase("base", model, teacher_loss_fn(), cfg.teacher_steps, cfg.teacher_lr, cfg.batch_size,
                                  cfg, batches, device, args.log_every)

    data_id = data_fingerprint(tokenizer, batches, cfg.seed)
    model, _, _ = run_phase("base", folder, cfg, args.restart, device, train, data_id)
    base = os.path.join(folder, "base")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    seconds = time.perf_counter() - start
    print(f"== done in {format_seconds(seconds)}: {base} (Hugging Face layout); next: "
          f"python finetune_hf.py train --model {base} --data {train_file} ...")
    return {"base": base, "train": str(train_file), "test": str(test_file), "seconds": seconds}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = RunConfig(seed=args.seed, **(QUICK if args.quick else {}))
    for name in ("teacher_steps", "mtp_steps", "n_eval"):
        if getattr(args, name) is not None:
            cfg = replace(cfg, **{name: getattr(args, name)})
    torch.set_num_threads(args.threads)
    try:
        device = parse_device(args.device)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if args.word_problems:
        return word_problem_base_model(args, device)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    tokenizer = data.toy_tokenizer()

    batches = toy_batches(cfg, tokenizer)              # the same token ids with and without <mask>

    def train_teacher():
        model = build_teacher(cfg, tokenizer, device)
        print(f"  teacher: {model.num_params() / 1e6:.2f}M parameters, vocabulary {tokenizer.n_vocab}")
        log = train_phase("teacher", model, teacher_loss_fn(), cfg.teacher_steps, cfg.teacher_lr, cfg.batch_size,
                          cfg, batches, device, args.log_every)
        return model, log

    data_id = data_fingerprint(tokenizer, batches, cfg.seed)
    teacher, teacher_log, teacher_s = run_phase("teacher", args.out, cfg, args.restart, device, train_teacher, data_id)
    models, logs, seconds = {"ntp": teacher}, {"teacher": teacher_log}, {"teacher": teacher_s}
    for name, mode in STUDENT_MODE.items():
        def train_student(mode=mode, name=name):
            student, s_tok = student_from(teacher, device)
            frozen = frozen_teacher(student)           # the starting point, <mask> included
            log = train_phase(name, student, student_loss_fn(frozen, mode, cfg, s_tok), cfg.mtp_steps, cfg.mtp_lr,
                              cfg.mtp_batch_size, cfg, batches, device, args.log_every)
            return student, log
        models[name], logs[name], seconds[name] = run_phase(name, args.out, cfg, args.restart, device, train_student,
                                                            data_id)

    print("== evaluation on held-out prompts")
    t_eval = time.perf_counter()
    eval_sets = {task: data.heldout_examples(task, cfg.n_eval) for task in cfg.tasks}
    _, s_tok = student_from(teacher, "cpu")
    rows, samples = [], {}
    for name, model in models.items():
        r, s = evaluate(name, model, tokenizer if name == "ntp" else s_tok, eval_sets, cfg)
        rows += r
        samples[name] = s
        print_summary(name, r)
    seconds["evaluation"] = time.perf_counter() - t_eval

    draw_examples(models["distill"], s_tok, cfg, args.out)
    plot_pareto(rows, os.path.join(args.out, "pareto.png"))
    plot_training(logs, os.path.join(args.out, "training_curves.png"))
    if args.export_hf:
        export_hf(args.export_hf, teacher, models["distill"])
    seconds["total"] = time.perf_counter() - t_start
    results = {
        "rows": rows,
        "acceptance": acceptance(rows),
        "samples": samples,
        "seconds": seconds,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "n_params": teacher.num_params(),
        "config": asdict(cfg),
        "quick": args.quick,
    }
    with open(os.path.join(args.out, "results.json.tmp"), "w") as f:
        json.dump(results, f, indent=1)
    os.replace(os.path.join(args.out, "results.json.tmp"), os.path.join(args.out, "results.json"))
    print(json.dumps(results["acceptance"], indent=1))
    print(f"== done in {format_seconds(seconds['total'])}: {args.out}/results.json, pareto.png, training_curves.png, "
          f"attention_mask.png, chunks.png")
    return results


def print_summary(name: str, rows: list[dict]):
    """One line per decoding setting: accuracy / coherence / degeneration / effective k per task."""
    by_setting = {}
    for r in rows:
        label = {"static": f"static k={r['k']}", "confadapt": f"confadapt tau={r['tau']}",
                 "lossless": f"lossless k={r['k']}"}[r["decode"]]
        by_setting.setdefault(label, []).append(r)
    print(f"-- {name}: task acc/coh/degen effk")
    for label, rs in by_setting.items():
        cells = "  ".join(f"{r['task']} {r['accuracy']:.2f}/{r['coherence']:.2f}/{r['degeneration']:.2f} "
                          f"{r['effective_k']:.1f}" for r in rs)
        print(f"   {label:<18} {cells}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--out", default="runs/toy", help="output folder: results.json, plots, checkpoints/")
    run.add_argument("--quick", action="store_true", help="tiny model and few steps (for tests; about 10 seconds)")
    run.add_argument("--seed", type=int, default=0, help="seed for weights, data and layouts")
    run.add_argument("--restart", action="store_true", help="ignore checkpoints in --out and train every phase again")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    hw.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    budget = p.add_argument_group("budget (override the defaults)")
    budget.add_argument("--teacher-steps", type=int, default=None, help="next-token training steps of the teacher")
    budget.add_argument("--mtp-steps", type=int, default=None, help="MTP training steps of each student")
    budget.add_argument("--n-eval", type=int, default=None, help="held-out prompts per task")
    output = p.add_argument_group("output")
    output.add_argument("--export-hf", default=None, metavar="DIR",
                        help="also save DIR/teacher and DIR/student (distilled) in Hugging Face layout")
    output.add_argument("--log-every", type=int, default=1, help="print a progress line every this many steps")
    other = p.add_argument_group("the miniature of finetune_hf.py (README)")
    other.add_argument("--word-problems", default=None, metavar="DIR",
                       help="instead of the toy run: write word-problem data to DIR/data and train a small "
                            "Llama-layout base model on them, saved to DIR/base (Hugging Face layout)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
