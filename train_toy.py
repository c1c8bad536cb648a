"""The whole method on a CPU in minutes: NTP teacher -> naive vs distilled MTP -> evaluation -> plots.

    python train_toy.py                      full run (about 9 minutes on 2 CPU cores), into runs/toy
    python train_toy.py --quick              smoke test (about 12 seconds), into runs/toy-quick
    python train_toy.py --export-hf hf_toy   after a run: save its teacher and both students in
                                             Hugging Face layout (hf_toy/teacher, naive, distill)
    python train_toy.py --word-problems runs/wp   phase 1 only, on word problems: the base model
                                             of finetune_hf.py's miniature (see the end of this file)

What happens (data.py describes the four toy tasks, two of which have branch points):

  1. teacher   a small Llama-style transformer trained from scratch with next-token prediction.
  2. students  two copies of the teacher, each given a `<mask>` token (model.add_mask_token) and
               trained for multi-token prediction with the same data, steps and learning rate:
                 naive    cross-entropy against the ground-truth next k tokens   (mode "gt")
                 distill  student-forced self-distillation from the frozen teacher (mode "hard")
               Every step draws k in [2, k_max] and the region offset independently and packs
               the batch with data.mtp_layout.
  3. evaluate  teacher, naive and distilled on held-out prompts (parameters never trained on):
               static k = 1..k_max, ConfAdapt over a sweep of thresholds tau, and the lossless
               mode, all through confadapt.generate with its KV cache. Per (model, decoding,
               task): accuracy, coherence, degeneration rate, effective k (tokens per forward
               pass), tokens/second.
  4. report    OUT/results.json and plots: accuracy and coherence against effective k (the
               speed/quality picture), training curves, the training attention mask, and one
               generation drawn as coloured chunks, one chunk per forward pass.

Each phase checkpoints OUT/checkpoints/<phase>.pt atomically; running again with the same
settings skips finished phases (--restart retrains everything). The default OUT is named after
the settings that change the results (runs/toy, runs/toy-quick, runs/toy-seed1, ...), and a
folder holding a run of other settings is only replaced with --restart: a smoke test or another
seed never overwrites the full run.
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
from confadapt import (CliError, DecodeConfig, Parser, Progress, chunk_texts, count, format_seconds, generate,
                       output_folder, positive_int, run_cli, save_chunks_png)
from distill import frozen_teacher, mtp_loss
from model import ModelConfig, Transformer, add_mask_token, atomic_save, parse_device, read_checkpoint, read_json

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


# What one unit of each phase costs, in teacher steps, for the run's overall ETA: an MTP step
# packs up to 8x more positions per row (distill adds the teacher's forward); one prompt decoded
# with one setting is a few cached passes. Measured with --threads 1 on the 2-core AMD EPYC.
COST = {"base": 1.0, "teacher": 1.0, "naive": 3.0, "distill": 3.9, "evaluation": 0.02}


def run_eta(plan: dict, phase: str, done: int, total: int, elapsed: float) -> float:
    """Seconds to the end of the run: the rest of this phase at its measured pace, then every
    later phase of `plan` (phase -> units to do, in order) at the same pace per teacher step."""
    per_unit = elapsed / max(1, done)
    later = list(plan)[list(plan).index(phase) + 1:] if phase in plan else []
    return per_unit * (total - done) + per_unit / COST[phase] * sum(plan[p] * COST[p] for p in later)


def train_phase(name: str, model, loss_fn, steps: int, lr: float, batch_size: int, cfg: RunConfig, next_batch,
                device, plan: dict | None = None) -> list[dict]:
    """AdamW over fresh batches `next_batch(rng, batch_size) -> (seqs, answer)`, the data stream
    depending only on the seed; returns the log. A progress line every few seconds, with the
    ETA of this phase and of the whole run (`plan`: the phases still to come, see run_eta)."""
    opt = model.configure_optimizer(lr, cfg.weight_decay)
    rng = random.Random(cfg.seed + 1)                    # the same batches for every student
    gen = torch.Generator().manual_seed(cfg.seed + 2)    # the same k / offset draws too
    model.train()
    log, start, progress = [], time.perf_counter(), Progress()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr, cfg.warmup_steps)
        seqs, answer = next_batch(rng, batch_size)                                           # (B, N) each
        loss, stats = loss_fn(model, seqs.to(device), answer.to(device), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - start
        stats.update(step=step, seconds=elapsed, lr=opt.param_groups[0]["lr"])
        log.append(stats)
        if progress.due(last=step + 1 == steps):
            tok_s = (step + 1) * seqs.numel() / elapsed
            eta = elapsed / (step + 1) * (steps - step - 1)
            extra = f" k {stats['k']}" if "k" in stats else ""
            print(f"[{name}] step {step + 1:4d}/{steps} | loss {stats['loss']:.4f}{extra} | {tok_s:,.0f} tok/s | "
                  f"{format_seconds(elapsed)} | eta {format_seconds(eta)}, run "
                  f"{format_seconds(run_eta(plan or {}, name, step + 1, steps, elapsed))}", flush=True)
    model.eval()
    return log


def teacher_loss_fn():
    return lambda model, seqs, answer, gen: ntp_loss(model, seqs, answer)


def student_loss_fn(teacher, mode: str, cfg: RunConfig, tokenizer):
    """mtp_loss on a freshly drawn layout: k in [2, k_max] and the offset, independently."""
    def loss_fn(model, seqs, answer, gen):
        batch = data.random_mtp_layout(seqs, cfg.k_max, tokenizer.mask_id, tokenizer.eos_id, tokenizer.pad_id,
                                       n_regions=cfg.n_regions, generator=gen, trained=answer)
        return mtp_loss(model, teacher, batch, mode=mode,
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


def key_changes(saved: dict, key: dict) -> str:
    """What differs between two settings dicts, as `name old -> new, ...`."""
    return ", ".join(f"{k} {saved.get(k)} -> {key.get(k)}" for k in sorted({*saved, *key}, key=str)
                     if saved.get(k) != key.get(k))


def load_checkpoint(path: str, key: dict, device):
    """(model, log, seconds) if `path` holds a finished phase, else None. A phase trained with
    other settings is an error: it belongs to another run (check_run_folder)."""
    if not os.path.exists(path):
        return None
    try:
        ckpt = read_checkpoint(path, "toy checkpoint")
    except ValueError as e:
        raise CliError(f"{e}; --restart trains every phase again") from None
    if ckpt["key"] != key:
        raise CliError(f"{path} was trained with other settings ({key_changes(ckpt['key'], key)}): "
                       f"choose another --out, or add --restart to train again")
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
    print(f"== {name}: trained in {format_seconds(seconds)} (final loss {log[-1]['loss']:.4f}), saved {path}")
    return model, log, seconds


def check_run_folder(out: str, cfg: RunConfig, data_id: str, phases) -> list[str]:
    """Before any work: the phases whose checkpoints in `out` can be reused. A checkpoint or a
    results.json of other settings means `out` holds another run: an error (--restart replaces it)."""
    done = []
    for phase in phases:
        path = os.path.join(out, "checkpoints", f"{phase}.pt")
        if os.path.exists(path):
            load_checkpoint(path, cfg.phase_key(phase, data_id), "cpu")      # raises if it is another run's
            done.append(phase)
    results = os.path.join(out, "results.json")
    if os.path.exists(results):
        saved, now = read_json(results, "results file").get("config", {}), json.loads(json.dumps(asdict(cfg)))
        if saved != now:
            raise CliError(f"{results} comes from other settings ({key_changes(saved, now)}): choose another "
                           f"--out, or add --restart to replace that run")
    return done


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


def evaluate(name: str, model, tokenizer, eval_sets: dict, cfg: RunConfig, tick=lambda n: None
             ) -> tuple[list[dict], dict]:
    """One results row per (decoding, task), plus a few sample outputs for the log; tick(n) after
    each row, n its prompts (for the progress line)."""
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
            tick(n)
    return rows, samples


def cell(rows, **match) -> dict | None:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return found[0] if found else None


# The closing table, the README's claims one row per task: (column, the results row, its metrics).
SUMMARY = (("teacher k=1", dict(model="ntp", decode="static", k=1), ("accuracy",)),
           ("naive k=4", dict(model="naive", decode="static", k=4), ("coherence", "degeneration")),
           ("distill k=4", dict(model="distill", decode="static", k=4), ("coherence", "degeneration")),
           ("naive tau=0.9", dict(model="naive", decode="confadapt", tau=0.9), ("accuracy", "effective_k")),
           ("distill tau=0.9", dict(model="distill", decode="confadapt", tau=0.9), ("accuracy", "effective_k")))


def summary(rows: list[dict]) -> dict:
    """{task: {"column: metric": value}} at full precision (results.json); format_summary rounds it."""
    out = {}
    for task in sorted({r["task"] for r in rows}, key=data.TOY_TASKS.index):
        out[task] = {}
        for column, match, metrics in SUMMARY:
            found = cell(rows, task=task, **match)
            out[task].update({f"{column}: {m}": found[m] for m in metrics if found})
    return out


def format_summary(table: dict) -> str:
    """The table for people: percentages, and tokens per forward pass in brackets."""
    def text(row, column, metrics):
        if f"{column}: {metrics[0]}" not in row:
            return "-"
        a, b = (row.get(f"{column}: {m}") for m in (*metrics, None)[:2])
        return (f"{100 * a:.0f}%" + ("" if b is None else f" / {100 * b:.0f}%" if metrics[1] == "degeneration"
                                     else f" ({b:.2f})"))
    short = {"accuracy": "acc.", "coherence": "coh.", "degeneration": "degen.", "effective_k": "(tok/pass)"}
    lines = [["", *(c for c, _, _ in SUMMARY)],
             ["task", *(" / ".join(short[m] for m in ms).replace(" / (", " (") for _, _, ms in SUMMARY)]]
    lines += [[t + (" (branching)" if t in data.BRANCHING_TASKS else "")] + [text(row, c, ms) for c, _, ms in SUMMARY]
              for t, row in table.items()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    body = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
            for line in lines]
    return "\n".join(body + ["held-out prompts; acc. = accuracy, coh. = coherent, degen. = degenerate (one item "
                              "repeated); k=4: static k, tau=0.9: ConfAdapt; tok/pass: tokens per forward pass"])


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------

STYLE = {"ntp": ("black", "*"), "naive": ("tab:red", "o"), "distill": ("tab:blue", "s")}


def plot_pareto(rows: list[dict], path: str):
    """Accuracy and degeneration against effective k, one column per task: static k (solid),
    ConfAdapt's tau sweep (dashed), lossless (hollow marker), the teacher at k = 1 (star); each
    student point is labelled with its k or tau. (Coherence is not drawn: a trained model's
    answers have the right length, so on these tasks it equals accuracy.)"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows}, key=data.TOY_TASKS.index)
    fig, axes = plt.subplots(2, len(tasks), figsize=(4 * len(tasks), 7.5), squeeze=False)
    for col, task in enumerate(tasks):
        for row, metric in enumerate(("accuracy", "degeneration")):
            ax = axes[row][col]
            for name in MODELS:
                colour, marker = STYLE[name]
                for decode, line in (("static", "-"), ("confadapt", "--")):
                    cells = [r for r in rows if r["model"] == name and r["task"] == task and r["decode"] == decode]
                    cells.sort(key=lambda r: r["k"] if decode == "static" else -r["tau"])   # in sweep order
                    if not cells:
                        continue
                    ax.plot([r["effective_k"] for r in cells], [r[metric] for r in cells], line, color=colour,
                            marker=marker, ms=4 if name != "ntp" else 12, label=f"{name} {decode}")
                    for r in cells if name != "ntp" else []:
                        ax.annotate(f"k{r['k']}" if decode == "static" else f"τ{r['tau']:g}",
                                    (r["effective_k"], r[metric]), textcoords="offset points", color=colour,
                                    xytext=(3, 4 if decode == "static" else -9), fontsize=6)
                for r in rows:
                    if r["model"] == name and r["task"] == task and r["decode"] == "lossless":
                        ax.plot(r["effective_k"], r[metric], marker="D", mfc="none", color=colour, ms=8,
                                ls="none", label=f"{name} lossless")
            ax.set_title(f"{task}{' (branching)' if task in data.BRANCHING_TASKS else ''}")
            ax.set_xlabel("effective k (tokens per forward pass)")
            ax.set_ylabel(metric if metric == "accuracy" else "degeneration (one item repeated)")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("held-out prompts: quality against tokens per forward pass (labels: static k, ConfAdapt tau)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(logs: dict, path: str):
    """One panel per phase: the three losses are different quantities, so they get their own axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"teacher": "teacher: next-token cross-entropy",          # the students' add prefix_ntp_weight x that
              "naive": "naive: cross-entropy to the true next k (+ NTP)",
              "distill": "distill: cross-entropy over the teacher's (+ NTP)"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, title) in zip(axes, titles.items()):
        log = logs[name]
        ax.plot([s["step"] for s in log], [s["loss"] for s in log], color=STYLE["ntp" if name == "teacher" else name][0],
                lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if name != "distill":                  # distill's MTP term is relative to the teacher: it can go below 0
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


def export_hf(path: str, models: dict):
    """DIR/teacher, DIR/naive and DIR/distill in Hugging Face layout, each with its tokenizer (the
    students' knows <mask>): both students, so confadapt.py can show the naive one's collapse too."""
    _, student_tokenizer = student_from(models["ntp"], "cpu")
    for name, model in models.items():
        folder = os.path.join(path, "teacher" if name == "ntp" else name)
        model.save_pretrained(folder)
        (data.toy_tokenizer() if name == "ntp" else student_tokenizer).save_pretrained(folder)
    print(f"exported {path}/teacher, {path}/naive and {path}/distill (Hugging Face layout)")


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
    tokenizer = data.word_problem_tokenizer()
    n_train = 200 if args.quick else 20_000

    def batches(rng, batch_size):
        return data.word_problem_batch(tokenizer, pairs, rng, batch_size, cfg.seq_len)

    start = time.perf_counter()
    train_file, test_file = data.write_word_problems(os.path.join(folder, "data"), n_train=n_train,
                                                     n_test=10 if args.quick else 500, seed=args.seed)
    pairs = data.word_problem_pairs(train_file)
    print(f"wrote {train_file} ({len(pairs)} MetaMathQA-format rows) and {test_file} (GSM8K-format rows)")

    def train():
        model = build_teacher(cfg, tokenizer, device, tie_embeddings=False, context=WORD_PROBLEM_CONTEXT)
        print(f"  base model: {model.num_params() / 1e6:.2f}M parameters, vocabulary {tokenizer.n_vocab}")
        return model, train_phase("base", model, teacher_loss_fn(), cfg.teacher_steps, cfg.teacher_lr, cfg.batch_size,
                                  cfg, batches, device, {"base": cfg.teacher_steps})

    data_id = data_fingerprint(tokenizer, batches, cfg.seed)
    if not args.restart:
        check_run_folder(folder, cfg, data_id, ["base"])
    model, _, _ = interruptible(folder, ["base"], lambda: run_phase("base", folder, cfg, args.restart, device, train,
                                                                     data_id))
    base = os.path.join(folder, "base")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    seconds = time.perf_counter() - start
    print(f"== done in {format_seconds(seconds)}: {base} (Hugging Face layout); next: "
          f"python finetune_hf.py train --model {base} --data {train_file} ...")
    return {"base": base, "train": str(train_file), "test": str(test_file), "seconds": seconds}


def interruptible(out: str, phases, work):
    """work(), with Ctrl-C turned into one line: which phases are saved and how to go on."""
    try:
        return work()
    except KeyboardInterrupt:
        saved = [p for p in phases if os.path.exists(os.path.join(out, "checkpoints", f"{p}.pt"))]
        raise KeyboardInterrupt(f"{out}/checkpoints holds {', '.join(saved) or 'no finished phase yet'}; "
                                f"run the same command again to continue from there") from None


def default_out(args, cfg: RunConfig) -> str:
    """runs/toy for the default settings; each setting that changes the results adds to the name
    (runs/toy-quick, runs/toy-seed1, runs/toy-teacher300-mtp40), so runs never share a folder."""
    base = RunConfig(**(QUICK if args.quick else {}))
    parts = ["quick"] if args.quick else []
    parts += [f"{short}{getattr(cfg, name)}" for name, short in (("seed", "seed"), ("teacher_steps", "teacher"),
                                                                ("mtp_steps", "mtp"), ("n_eval", "eval"))
              if getattr(cfg, name) != getattr(base, name)]
    return os.path.join("runs", "-".join(["toy"] + parts))


def main(argv=None) -> dict:
    """The toy run (or --export-hf, or --word-problems); returns what it wrote to results.json."""
    args = parse_args(argv)
    cfg = RunConfig(seed=args.seed, **(QUICK if args.quick else {}))
    for name in ("teacher_steps", "mtp_steps", "n_eval"):
        if getattr(args, name) is not None:
            cfg = replace(cfg, **{name: getattr(args, name)})
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    if args.word_problems:
        output_folder(args.word_problems, "--word-problems")
        return word_problem_base_model(args, device)
    out = args.out or default_out(args, cfg)
    output_folder(out, "--out")
    tokenizer = data.toy_tokenizer()
    batches = toy_batches(cfg, tokenizer)              # the same token ids with and without <mask>
    data_id = data_fingerprint(tokenizer, batches, cfg.seed)
    phases = ["teacher", *STUDENT_MODE]
    done = [] if args.restart else check_run_folder(out, cfg, data_id, phases)
    if args.export_hf:
        return export_run(args.export_hf, out, cfg, data_id, device, done)
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    eval_sets = {task: data.heldout_examples(task, cfg.n_eval) for task in cfg.tasks}
    eval_units = sum(map(len, eval_sets.values())) * (len(decodings(cfg, False)) + 2 * len(decodings(cfg, True)))
    plan = {"teacher": cfg.teacher_steps, "naive": cfg.mtp_steps, "distill": cfg.mtp_steps}
    plan = {**{p: n for p, n in plan.items() if p not in done}, "evaluation": eval_units}
    print(f"== {out}: {', '.join(p for p in plan if p != 'evaluation') or 'nothing'} to train, "
          f"{', '.join(done) or 'nothing'} loaded from checkpoints/")

    def train_teacher():
        model = build_teacher(cfg, tokenizer, device)
        print(f"  teacher: {model.num_params() / 1e6:.2f}M parameters, vocabulary {tokenizer.n_vocab}")
        log = train_phase("teacher", model, teacher_loss_fn(), cfg.teacher_steps, cfg.teacher_lr, cfg.batch_size,
                          cfg, batches, device, plan)
        return model, log

    def train_all():
        teacher, teacher_log, teacher_s = run_phase("teacher", out, cfg, args.restart, device, train_teacher, data_id)
        models, logs, seconds = {"ntp": teacher}, {"teacher": teacher_log}, {"teacher": teacher_s}
        for name, mode in STUDENT_MODE.items():
            def train_student(mode=mode, name=name):
                student, s_tok = student_from(teacher, device)
                frozen = frozen_teacher(student)           # the starting point, <mask> included
                log = train_phase(name, student, student_loss_fn(frozen, mode, cfg, s_tok), cfg.mtp_steps,
                                  cfg.mtp_lr, cfg.mtp_batch_size, cfg, batches, device, plan)
                return student, log
            models[name], logs[name], seconds[name] = run_phase(name, out, cfg, args.restart, device, train_student,
                                                                data_id)
        return models, logs, seconds

    models, logs, seconds = interruptible(out, phases, train_all)
    print(f"== evaluation on held-out prompts: {', '.join(models)}")
    t_eval, progress, evaluated = time.perf_counter(), Progress(), [0]
    _, s_tok = student_from(models["ntp"], "cpu")

    def tick(n):
        evaluated[0] += n
        if progress.due(last=evaluated[0] == eval_units):
            eta = run_eta(plan, "evaluation", evaluated[0], eval_units, time.perf_counter() - t_eval)
            print(f"[evaluation] {evaluated[0]:,}/{eval_units:,} prompts x settings | "
                  f"{format_seconds(time.perf_counter() - t_eval)} | eta {format_seconds(eta)}", flush=True)

    rows, samples = [], {}
    for name, model in models.items():
        r, samples[name] = interruptible(out, phases, lambda: evaluate(name, model, tokenizer if name == "ntp"
                                                                       else s_tok, eval_sets, cfg, tick))
        rows += r
    seconds["evaluation"] = time.perf_counter() - t_eval
    print(f"== evaluation: {len(rows)} rows in {format_seconds(seconds['evaluation'])}")

    draw_examples(models["distill"], s_tok, cfg, out)
    plot_pareto(rows, os.path.join(out, "pareto.png"))
    plot_training(logs, os.path.join(out, "training_curves.png"))
    seconds["total"] = time.perf_counter() - t_start
    results = {
        "rows": rows,
        "summary": summary(rows),
        "samples": samples,
        "seconds": seconds,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "n_params": models["ntp"].num_params(),
        "config": asdict(cfg),
        "quick": args.quick,
    }
    with open(os.path.join(out, "results.json.tmp"), "w") as f:
        json.dump(results, f, indent=1)
    os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))
    print(format_summary(results["summary"]))
    print(f"== done in {format_seconds(seconds['total'])}: {out}/results.json (every row, full precision), "
          f"pareto.png, training_curves.png, attention_mask.png, chunks.png")
    return results


def export_run(path: str, out: str, cfg: RunConfig, data_id: str, device, done: list[str]) -> dict:
    """--export-hf: the finished run in `out` (these settings) as Hugging Face folders; no training."""
    missing = [p for p in ("teacher", *STUDENT_MODE) if p not in done]
    if missing:
        raise CliError(f"--export-hf: {out} has no finished {', '.join(missing)} for these settings; run the "
                       f"same command without --export-hf first")
    output_folder(path, "--export-hf")
    models = {"ntp" if p == "teacher" else p: load_checkpoint(os.path.join(out, "checkpoints", f"{p}.pt"),
                                                             cfg.phase_key(p, data_id), device)[0]
              for p in ("teacher", *STUDENT_MODE)}
    export_hf(path, models)
    return {"export": path, "models": list(models)}


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    run = p.add_argument_group("run")
    run.add_argument("--out", default=None,
                     help="output folder: results.json, plots, checkpoints/ (default: runs/toy, or named after the "
                          "settings that differ from the default, e.g. runs/toy-quick, runs/toy-seed1)")
    run.add_argument("--quick", action="store_true", help="tiny model and few steps (for tests; about 10 seconds)")
    run.add_argument("--seed", type=count, default=0, help="seed for weights, data and layouts")
    run.add_argument("--restart", action="store_true",
                     help="train every phase again, replacing the checkpoints and results in --out")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    hw.add_argument("--threads", type=positive_int, default=1,
                    help="torch CPU threads: the toy's matrices are small, and a second thread made steps 4-15x "
                         "slower whenever another job was using a core (README)")
    budget = p.add_argument_group("budget (override the defaults)")
    budget.add_argument("--teacher-steps", type=positive_int, default=None,
                        help=f"next-token training steps of the teacher (default: {RunConfig.teacher_steps}, "
                             f"--quick {QUICK['teacher_steps']})")
    budget.add_argument("--mtp-steps", type=positive_int, default=None,
                        help=f"MTP training steps of each student (default: {RunConfig.mtp_steps}, "
                             f"--quick {QUICK['mtp_steps']})")
    budget.add_argument("--n-eval", type=positive_int, default=None,
                        help=f"held-out prompts per task, at most (default: {RunConfig.n_eval}, "
                             f"--quick {QUICK['n_eval']})")
    output = p.add_argument_group("export")
    output.add_argument("--export-hf", default=None, metavar="DIR",
                        help="only export the finished run in --out (same settings): DIR/teacher, DIR/naive and "
                             "DIR/distill in Hugging Face layout, in seconds")
    other = p.add_argument_group("the miniature of finetune_hf.py (README)")
    other.add_argument("--word-problems", default=None, metavar="DIR",
                       help="instead of the toy run: write word-problem data to DIR/data and train a small "
                            "Llama-layout base model on them, saved to DIR/base (Hugging Face layout)")
    args = p.parse_args(argv)
    if args.word_problems and (args.export_hf or args.out or args.mtp_steps or args.n_eval):
        raise CliError("--word-problems DIR trains the base model alone: --out, --export-hf, --mtp-steps "
                       "and --n-eval do not apply")
    return args


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
