"""The method on a CPU in minutes: NTP teacher -> naive vs distilled MTP -> evaluation -> plots.

    python train_toy.py                     full run (about 8 minutes on 2 CPU cores), into runs/toy
    python train_toy.py --quick             smoke test (about 12 seconds), into runs/toy-quick
    python train_toy.py --export-hf hf_toy  a finished run's three models in Hugging Face layout
    python train_toy.py --word-problems runs/wp   the base model of finetune_hf.py's miniature

1. teacher: a small Llama-style transformer learns data.py's five toy tasks by next-token prediction
2. students: two copies with a `<mask>` token learn multi-token prediction on the same batches and
   layouts: "naive" against the true next k tokens, "distill" by student-forced self-distillation
3. evaluation: static k, ConfAdapt and lossless decoding -> OUT/results.json, a table, plots
Each phase is saved to OUT/checkpoints/ and resumed (--restart retrains); OUT names the settings.
"""

import json
import math
import os
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

import data
from cli import (CliError, Parser, Progress, count, format_seconds, output_folder, parse_device,
                 positive_int, provenance, read_checkpoint, run_cli)
from confadapt import DecodeConfig, chunk_texts, decode_modes, generate, save_chunks_png
from distill import frozen_teacher, mtp_loss
from model import ModelConfig, Transformer, add_mask_token, atomic_save, read_json, write_json

MODELS = ("ntp", "naive", "distill")          # names used in results.json
STUDENT_MODE = {"naive": "gt", "distill": "hard"}
PHASES = ("teacher", *STUDENT_MODE)           # one checkpoint each

@dataclass
class RunConfig:
    dim: int = 128                     # the model
    n_layers: int = 3
    n_heads: int = 4
    ffn_dim: int = 384
    tasks: tuple = data.TOY_TASKS      # the data: tasks drawn uniformly
    seq_len: int = data.TOY_SEQ_LEN    # every toy sequence fits (the longest, repeat, is 21 tokens)
    batch_size: int = 32               # phase 1, the teacher: next-token prediction
    teacher_steps: int = 3000          # near the floor: 2,000 steps failed one seed of three
    teacher_lr: float = 4e-3
    mtp_batch_size: int = 16           # phase 2, the students: MTP, the same budget for both
    mtp_steps: int = 700               # an MTP step costs 3-4x a teacher step
    mtp_lr: float = 2e-3
    k_max: int = 8
    n_regions: int = 21                # = seq_len: every token ends a region (paper: N / (2 k_max), 1 here)
    prefix_ntp_weight: float = 1.0     # next-token loss on the ground-truth answer tokens too
    warmup_steps: int = 20
    weight_decay: float = 0.1
    n_eval: int = 200                  # phase 3: prompts per task at most (count 84, count_free 27)
    static_ks: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    taus: tuple = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
    max_new_tokens: int = 24           # answers are at most 13 items + <|eos|>
    seed: int = 0

    def phase_key(self, phase: str, data_id: str = "") -> dict:
        """What a phase's checkpoint depends on: settings and data (`data_fingerprint`)."""
        shared = ["dim", "n_layers", "n_heads", "ffn_dim", "tasks", "seq_len", "batch_size",
                  "teacher_steps", "teacher_lr", "warmup_steps", "weight_decay", "seed"]
        if phase in STUDENT_MODE:
            shared += ["mtp_batch_size", "mtp_steps", "mtp_lr", "k_max", "n_regions", "prefix_ntp_weight"]
        return {**{name: getattr(self, name) for name in shared}, "data": data_id}

QUICK = dict(dim=64, n_layers=2, ffn_dim=192, batch_size=16, teacher_steps=40, mtp_batch_size=8, mtp_steps=20,
             warmup_steps=5, n_eval=6, static_ks=(1, 4), taus=(0.5, 0.9), max_new_tokens=16)

# --- 1-2. Training: one loop for the teacher and both students -------------------------------
def train_phase(name: str, model: Transformer, cfg: RunConfig, next_batch, device, plan: dict | None = None,
                mode: str | None = None, tokenizer=None) -> tuple[Transformer, list[dict]]:
    """AdamW -> (model in eval mode, log). mode None: next-token loss (cfg.teacher_*); "gt" or
    "hard": MTP (cfg.mtp_*; `tokenizer` knows <mask>). next_batch(rng, B) -> (seqs, answer)."""
    student = mode is not None
    steps, peak, batch_size = ((cfg.mtp_steps, cfg.mtp_lr, cfg.mtp_batch_size) if student else
                               (cfg.teacher_steps, cfg.teacher_lr, cfg.batch_size))
    teacher = frozen_teacher(model) if student else None    # self-distillation: the student's start, frozen
    opt = model.configure_optimizer(peak, cfg.weight_decay)
    rng = random.Random(cfg.seed + 1)                   # the batches, the same for both students,
    gen = torch.Generator().manual_seed(cfg.seed + 2)   # and so are each step's k and region offset
    print(f"  {name}: {model.num_params() / 1e6:.2f}M parameters, {model.config.vocab_size} tokens")
    model.train()
    log, start, progress = [], time.perf_counter(), Progress()
    for step in range(steps):
        # the learning rate: linear warm-up, then cosine decay to 10% of the peak
        decay = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
        lr = peak * ((step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else
                     0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * decay)))
        for group in opt.param_groups:
            group["lr"] = lr
        seqs, answer = (t.to(device) for t in next_batch(rng, batch_size))     # (B, N) each
        if not student:
            # next-token cross-entropy on the answers (the prompts are random: nothing to learn)
            logits = model(seqs[:, :-1]).float()                               # (B, N-1, V)
            targets = seqs[:, 1:].masked_fill(~answer[:, 1:], -100)            # (B, N-1), -100: not trained
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
            stats = {"loss": float(loss.detach())}
        else:
            # MTP problems (k in [2, k_max], region offset drawn afresh); loss vs truth or teacher
            batch = data.random_mtp_layout(seqs, k_max=cfg.k_max, mask_id=tokenizer.mask_id,
                                           eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                           n_regions=cfg.n_regions, generator=gen, trained=answer)
            loss, stats = mtp_loss(model, teacher, batch, mode=mode, prefix_ntp_weight=cfg.prefix_ntp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - start
        log.append({**stats, "step": step, "seconds": elapsed, "lr": lr})
        if progress.due(last=step + 1 == steps):
            k = f" k {stats['k']}" if student else ""
            run_left = run_eta(plan or {}, name, done=step + 1, total=steps, elapsed=elapsed)
            print(f"[{name}] step {step + 1:4d}/{steps} | loss {stats['loss']:.4f}{k} | "
                  f"{(step + 1) * seqs.numel() / elapsed:,.0f} tok/s | {format_seconds(elapsed)} | "
                  f"eta {format_seconds(elapsed / (step + 1) * (steps - step - 1))}, "
                  f"run {format_seconds(run_left)}", flush=True)
    return model.eval(), log

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

# --- 3. Evaluation: every model with every decoding setting on every task --------------------
def sweep(cfg: RunConfig, multi_token: bool) -> list[DecodeConfig]:
    """The decoding settings; without <mask>, greedy only (called static k=1: the curve's start)."""
    if multi_token:
        modes = decode_modes(static_ks=cfg.static_ks, taus=cfg.taus, k_max=cfg.k_max,
                             lossless_k=cfg.k_max)
    else:
        modes = decode_modes(static_ks=(1,))
    return [DecodeConfig("static", k=1) if m.kind == "greedy" else m for m in modes]

def evaluate(models: dict, tokenizer, eval_sets: dict, cfg: RunConfig, plan: dict) -> tuple[list[dict], dict]:
    """One results row per (model, decoding, task) and one sample output each (passes marked |)."""
    rows, samples = [], {name: {} for name in models}
    done, total, start, progress = 0, plan["evaluation"], time.perf_counter(), Progress()
    for name, model in models.items():
        for mode in sweep(cfg, model.config.mask_token_id is not None):
            for task, examples in eval_sets.items():
                prompts = [data.encode_example(tokenizer, ex)[0] for ex in examples]
                gens, stats = generate(model, prompts, cfg.max_new_tokens, mode=mode, stop_ids=[tokenizer.eos_id])
                answers = [(tokenizer.decode(g.tokens[:-1] if g.stopped else g.tokens), g.stopped) for g in gens]
                scores = [data.check_toy(task, ex.key, *a) for ex, a in zip(examples, answers)]
                n = len(scores)
                rows.append({"model": name, "decode": mode.kind, "k": mode.block,
                             "tau": mode.tau if mode.kind == "confadapt" else None, "task": task,
                             "accuracy": sum(s.accuracy for s in scores) / n,
                             "coherence": sum(s.coherence for s in scores) / n,
                             "degeneration": sum(s.degenerate for s in scores) / n,
                             "effective_k": stats.effective_k, "tokens_per_s": stats.tokens_per_second,
                             "forward_passes": stats.row_passes / n,         # per prompt, on average
                             "batch_forward_passes": stats.forward_passes,   # batched, all n at once
                             "n_prompts": n})
                # the first prompt's answer, each forward pass's tokens after a "|"
                passes = chunk_texts(tokenizer, gens[0].tokens, gens[0].chunk_sizes)
                marked = "".join(" |" + text for text in passes)
                samples[name][f"{task} | {mode.describe()}"] = examples[0].prompt + marked
                done += n
                if progress.due(last=done == total):
                    elapsed = time.perf_counter() - start
                    left = run_eta(plan, "evaluation", done=done, total=total, elapsed=elapsed)
                    print(f"[evaluation] {done:,}/{total:,} prompts x settings | {format_seconds(elapsed)} | "
                          f"eta {format_seconds(left)}", flush=True)
    return rows, samples

# The closing table, the README's claims one row per task: (column, the results row, its metrics).
SUMMARY = (("teacher k=1", dict(model="ntp", decode="static", k=1), ("accuracy",)),
           ("naive k=4", dict(model="naive", decode="static", k=4), ("coherence", "degeneration")),
           ("distill k=4", dict(model="distill", decode="static", k=4), ("coherence", "degeneration")),
           ("naive tau=0.9", dict(model="naive", decode="confadapt", tau=0.9), ("accuracy", "effective_k")),
           ("distill tau=0.9", dict(model="distill", decode="confadapt", tau=0.9), ("accuracy", "effective_k")))

def summary(rows: list[dict]) -> dict:
    """{task: {"column: metric": value}} at full precision; format_summary rounds it."""
    out = {task: {} for task in sorted({r["task"] for r in rows}, key=data.TOY_TASKS.index)}
    for task, values in out.items():
        for column, match, metrics in SUMMARY:
            row = next((r for r in rows if r["task"] == task and r.items() >= match.items()), None)
            values.update({f"{column}: {m}": row[m] for m in metrics} if row else {})
    return out

# --- The run: 1. teacher, 2. students, 3. evaluation, 4. report -----------------------------
def toy_run(args, cfg: RunConfig, out: str, device) -> dict:
    """Train (or load) the three models, evaluate them, report; return what results.json holds."""
    tokenizer = data.toy_tokenizer()                # a student's adds <mask>: the same ids
    batches = partial(data.toy_batch, tokenizer, tasks=cfg.tasks, seq_len=cfg.seq_len)
    data_id = data_fingerprint(tokenizer, batches, cfg.seed)
    done = {} if args.restart else check_run_folder(out, cfg, data_id, PHASES)
    if args.export_hf:
        return export_hf(args.export_hf, out, done)
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    eval_sets = {task: data.heldout_examples(task, cfg.n_eval) for task in cfg.tasks}
    plan = {p: n for p, n in zip(PHASES, (cfg.teacher_steps, cfg.mtp_steps, cfg.mtp_steps)) if p not in done}
    plan["evaluation"] = sum(map(len, eval_sets.values())) * (len(sweep(cfg, False)) + 2 * len(sweep(cfg, True)))
    print(f"== {out}: {', '.join(p for p in plan if p != 'evaluation') or 'nothing'} to train, "
          f"{', '.join(done) or 'nothing'} loaded from checkpoints/")
    # 1. the teacher, from scratch
    teacher, log, s = run_phase("teacher", out, cfg, done, device, lambda: train_phase(
        "teacher", build_teacher(cfg, tokenizer, device), cfg, batches, device, plan), data_id)
    models, logs, seconds = {"ntp": teacher}, {"teacher": log}, {"teacher": s}
    # 2. the students, from the teacher: the same batches and layouts, two losses
    for name, mode in STUDENT_MODE.items():
        student, s_tok = student_from(teacher, device)
        models[name], logs[name], seconds[name] = run_phase(name, out, cfg, done, device, lambda: train_phase(
            name, student, cfg, batches, device, plan, mode, s_tok), data_id)
    # 3. evaluation and report
    print(f"== evaluation on held-out prompts: {', '.join(models)}")
    t_eval = time.perf_counter()
    rows, samples = evaluate(models, s_tok, eval_sets, cfg, plan)     # the teacher just never meets <mask>
    seconds["evaluation"] = time.perf_counter() - t_eval
    print(f"== evaluation: {len(rows)} rows in {format_seconds(seconds['evaluation'])}")
    plot(rows, logs, models["distill"], s_tok, cfg, out)
    seconds["total"] = time.perf_counter() - t_start
    results = {"rows": rows, "summary": summary(rows), "samples": samples, "seconds": seconds,
               "device": str(device), "threads": torch.get_num_threads(),
               **provenance(next(teacher.parameters()).dtype),      # commit, cpu, dtype, torch
               "n_params": teacher.num_params(), "config": asdict(cfg), "quick": args.quick}
    write_json(os.path.join(out, "results.json"), results)
    print(format_summary(results["summary"]))
    print(f"== done in {format_seconds(seconds['total'])}: {out}/results.json (every row, full precision), "
          f"pareto.png, training_curves.png, chunks.png")
    return results

# --- plumbing: the ETA, the table, plots, checkpoints, export, word problems, command line ---

# A unit of each phase in teacher steps, for the ETA: an MTP step packs up to 8x more positions
# (distill adds the teacher's forward); a prompt decoded is a few cached passes (--threads 1, EPYC).
COST = {"base": 1.0, "teacher": 1.0, "naive": 3.0, "distill": 3.9, "evaluation": 0.02}

def run_eta(plan: dict, phase: str, done: int, total: int, elapsed: float) -> float:
    """Seconds left: this phase at its pace, then the later ones of `plan` (phase -> units)."""
    per_unit = elapsed / max(1, done)
    later = list(plan)[list(plan).index(phase) + 1:] if phase in plan else []
    return per_unit * (total - done) + per_unit / COST[phase] * sum(plan[p] * COST[p] for p in later)

def format_summary(table: dict) -> str:
    """The table for people: percentages, and tokens per forward pass in brackets."""
    cell = {("accuracy",): ("acc.", "{:.0%}"), ("accuracy", "effective_k"): ("acc. (tok/pass)", "{:.0%} ({:.2f})"),
            ("coherence", "degeneration"): ("coh. / degen.", "{:.0%} / {:.0%}")}   # header, format
    lines = [["", *(c for c, _, _ in SUMMARY)], ["task", *(cell[ms][0] for _, _, ms in SUMMARY)]]
    lines += [[t + (" (branching)" if t in data.BRANCHING_TASKS else "")] +
              [cell[ms][1].format(*(row[f"{c}: {m}"] for m in ms)) if f"{c}: {ms[0]}" in row else "-"
               for c, _, ms in SUMMARY] for t, row in table.items()]
    widths = [max(map(len, column)) for column in zip(*lines)]
    body = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
            for line in lines]
    return "\n".join(body + ["held-out prompts; acc. = accuracy, coh. = coherent, degen. = degenerate (one item "
                              "repeated); k=4: static k, tau=0.9: ConfAdapt; tok/pass: tokens per forward pass"])

def plot(rows: list[dict], logs: dict, model, tokenizer, cfg: RunConfig, out: str):
    """OUT/pareto.png (no coherence: it equals accuracy here), training_curves.png, chunks.png (a colour per pass).
    pareto.png shows the branching tasks alone: on the others every curve sits at 0 or 1."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")                  # files only, no window
    style = {"ntp": ("black", "*"), "naive": ("tab:red", "o"), "distill": ("tab:blue", "s")}
    present = sorted({r["task"] for r in rows}, key=data.TOY_TASKS.index)
    tasks = [t for t in present if t in data.BRANCHING_TASKS] or present
    fig, axes = plt.subplots(2, len(tasks), figsize=(4 * len(tasks), 7.5), squeeze=False)
    for col, task in enumerate(tasks):
        for ax, metric in zip(axes[:, col], ("accuracy", "degeneration")):
            for name, (colour, marker) in style.items():
                for decode, line in (("static", "-"), ("confadapt", "--"), ("lossless", "none")):
                    cells = sorted((r for r in rows if (r["model"], r["task"], r["decode"]) == (name, task, decode)),
                                   key=lambda r: -r["tau"] if decode == "confadapt" else r["k"])   # sweep order
                    if not cells:
                        continue
                    ax.plot([r["effective_k"] for r in cells], [r[metric] for r in cells], ls=line, color=colour,
                            label=f"{name} {decode}", **(dict(marker="D", mfc="none", ms=8) if decode == "lossless"
                                                         else dict(marker=marker, ms=12 if name == "ntp" else 4)))
                    for r in cells if name != "ntp" and decode != "lossless" else []:      # label with k or tau
                        ax.annotate(f"k{r['k']}" if decode == "static" else f"τ{r['tau']:g}",
                                    (r["effective_k"], r[metric]), textcoords="offset points", color=colour,
                                    xytext=(3, 4 if decode == "static" else -9), fontsize=6)
            ax.set(title=task, ylim=(-0.05, 1.05),
                   xlabel="effective k (tokens per forward pass)",
                   ylabel=metric if metric == "accuracy" else "degeneration (one item repeated)")
            ax.grid(alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("held-out prompts" + (" of the branching tasks" if set(tasks) <= set(data.BRANCHING_TASKS) else "")
                 + ": quality against tokens per forward pass (labels: static k, ConfAdapt tau)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(os.path.join(out, "pareto.png"), dpi=110)
    titles = {"teacher": "teacher: next-token cross-entropy",         # the students add prefix_ntp_weight x that
              "naive": "naive: cross-entropy to the true next k (+ NTP)",
              "distill": "distill: cross-entropy over the teacher's (+ NTP)"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, title) in zip(axes, titles.items()):
        ax.plot([s["step"] for s in logs[name]], [s["loss"] for s in logs[name]], lw=0.8,
                color=style["ntp" if name == "teacher" else name][0])
        ax.set_title(title, fontsize=10)
        ax.set(xlabel="step", ylabel="loss", yscale="linear" if name == "distill" else "log")  # distill can be < 0
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "training_curves.png"), dpi=110)
    plt.close("all")
    example, mode = data.heldout_examples("count", 1)[0], DecodeConfig("confadapt", tau=0.9, k_max=cfg.k_max)
    g = generate(model, [data.encode_example(tokenizer, example)[0]], cfg.max_new_tokens, mode=mode,
                 stop_ids=[tokenizer.eos_id])[0][0]
    save_chunks_png(os.path.join(out, "chunks.png"), example.prompt, chunk_texts(tokenizer, g.tokens, g.chunk_sizes),
                    g.chunk_sizes, title=f"distilled student, {mode.describe()}: {len(g.tokens)} tokens in "
                                         f"{g.forward_passes} forward passes")

def key_changes(saved: dict, key: dict) -> str:
    """What differs between two settings dicts, as `name old -> new, ...`."""
    return ", ".join(f"{k} {saved.get(k)} -> {key.get(k)}" for k in sorted({*saved, *key}, key=str)
                     if saved.get(k) != key.get(k))

def run_phase(name, out, cfg, done: dict, device, train, data_id: str = ""):
    """(model, log, seconds): done[name] if found, else train() -> (model, log), saved."""
    path, key = os.path.join(out, "checkpoints", f"{name}.pt"), cfg.phase_key(name, data_id)
    if name in done:
        model, log, seconds = done[name]
        print(f"== {name}: loaded {path} (trained in {seconds:.0f} s; --restart to retrain)")
        return model.to(device), log, seconds
    print(f"== {name}: training")
    start = time.perf_counter()
    model, log = train()
    seconds = time.perf_counter() - start
    ckpt = dict(model_config=asdict(model.config), state=model.state_dict(), log=log, seconds=seconds, key=key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_save(lambda tmp: torch.save(ckpt, tmp), path)   # a crash leaves the old file or the new, never half
    print(f"== {name}: trained in {format_seconds(seconds)} (final loss {log[-1]['loss']:.4f}), saved {path}")
    return model, log, seconds

def check_run_folder(out: str, cfg: RunConfig, data_id: str, phases) -> dict:
    """Before any work: {phase: (model, log, seconds)} in `out`; another run's is an error."""
    done = {}
    for phase in phases:
        path, key = os.path.join(out, "checkpoints", f"{phase}.pt"), cfg.phase_key(phase, data_id)
        if not os.path.exists(path):
            continue
        try:
            ckpt = read_checkpoint(path, "toy checkpoint")
        except ValueError as e:
            raise CliError(f"{e}; --restart trains every phase again") from None
        if ckpt["key"] != key:
            raise CliError(f"{path} was trained with other settings ({key_changes(ckpt['key'], key)}): "
                           f"choose another --out, or add --restart to train again")
        model = Transformer(ModelConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["state"])
        done[phase] = (model.eval(), ckpt["log"], ckpt["seconds"])
    results = os.path.join(out, "results.json")
    if os.path.exists(results):
        saved, now = read_json(results, "results file").get("config", {}), json.loads(json.dumps(asdict(cfg)))
        if saved != now:
            raise CliError(f"{results} comes from other settings ({key_changes(saved, now)}): choose another "
                           f"--out, or add --restart to replace that run")
    return done

def data_fingerprint(tokenizer, next_batch, seed: int) -> str:
    """The vocabulary size and a checksum of 256 sequences: a changed tokenizer or task retrains."""
    seqs, answer = next_batch(random.Random(seed), 256)
    return f"vocab {tokenizer.n_vocab}, crc {zlib.crc32(seqs.numpy().tobytes() + answer.numpy().tobytes())}"

def export_hf(path: str, out: str, done: dict) -> dict:
    """--export-hf: the models `done` of the run in `out` as DIR/<phase> in Hugging Face layout."""
    missing = [p for p in PHASES if p not in done]
    if missing:
        raise CliError(f"--export-hf: {out} has no finished {', '.join(missing)} for these settings; run the "
                       f"same command without --export-hf first")
    output_folder(path, "--export-hf")
    for phase in PHASES:
        tokenizer = data.toy_tokenizer() if phase == "teacher" else student_from(done["teacher"][0], "cpu")[1]
        done[phase][0].save_pretrained(os.path.join(path, phase))
        tokenizer.save_pretrained(os.path.join(path, phase))
    print(f"exported {path}/teacher, {path}/naive and {path}/distill (Hugging Face layout)")
    return {"export": path, "models": list(MODELS)}

# --word-problems: the base model of the miniature GSM8K (README, "Results").
WORD_PROBLEMS = dict(dim=128, n_layers=4, n_heads=4, ffn_dim=512, seq_len=64, batch_size=32, teacher_steps=1500,
                     teacher_lr=2e-3, warmup_steps=100, tasks=("word_problems",))
WORD_PROBLEMS_QUICK = dict(dim=32, n_layers=1, n_heads=2, ffn_dim=64, batch_size=4, teacher_steps=3, warmup_steps=1)
WORD_PROBLEM_CONTEXT = 512          # positions the base model supports: room for few-shot prompts

def word_problem_base_model(args, cfg: RunConfig, device) -> dict:
    """Phase 1 on word problems (into DIR/data) -> DIR/base, a base model for finetune_hf.py."""
    folder, tokenizer, start = args.word_problems, data.word_problem_tokenizer(), time.perf_counter()
    train_file, test_file = data.write_word_problems(os.path.join(folder, "data"), n_train=200 if args.quick
                                                     else 20_000, n_test=10 if args.quick else 500, seed=args.seed)
    pairs = [(row["query"], row["response"]) for row in json.loads(train_file.read_text("utf-8"))]
    print(f"wrote {train_file} ({len(pairs)} rows, MetaMathQA format) and {test_file} (GSM8K format)")
    batches = partial(data.word_problem_batch, tokenizer, pairs, seq_len=cfg.seq_len)   # question and solution
    data_id = data_fingerprint(tokenizer, batches, cfg.seed)
    done = {} if args.restart else check_run_folder(folder, cfg, data_id, ["base"])
    model, _, _ = run_phase("base", folder, cfg, done, device, lambda: train_phase(
        "base", build_teacher(cfg, tokenizer, device, tie_embeddings=False, context=WORD_PROBLEM_CONTEXT), cfg,
        batches, device, {"base": cfg.teacher_steps}), data_id)
    base = os.path.join(folder, "base")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    seconds = time.perf_counter() - start
    print(f"== done in {format_seconds(seconds)}: {base} (Hugging Face layout); next: "
          f"python finetune_hf.py train --model {base} --data {train_file} ...")
    return {"base": base, "train": str(train_file), "test": str(test_file), "seconds": seconds}

def default_out(args, cfg: RunConfig) -> str:
    """runs/toy, plus each setting that changes results: runs/toy-quick-seed1-teacher300-mtp40."""
    base = RunConfig(**(QUICK if args.quick else {}))
    short = {"seed": "seed", "teacher_steps": "teacher", "mtp_steps": "mtp", "n_eval": "eval"}
    parts = [f"{s}{getattr(cfg, n)}" for n, s in short.items() if getattr(cfg, n) != getattr(base, n)]
    return os.path.join("runs", "-".join(["toy"] + ["quick"] * args.quick + parts))

def main(argv=None) -> dict:
    args = parse_args(argv)
    quick = (WORD_PROBLEMS_QUICK if args.word_problems else QUICK) if args.quick else {}
    preset = {**(WORD_PROBLEMS if args.word_problems else {}), **quick}
    budget = {n: getattr(args, n) for n in ("teacher_steps", "mtp_steps", "n_eval")}   # given or None
    cfg = RunConfig(seed=args.seed, **{**preset, **{n: v for n, v in budget.items() if v is not None}})
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    folder = (output_folder(args.word_problems, "--word-problems") if args.word_problems
              else output_folder(args.out or default_out(args, cfg), "--out"))
    try:
        return word_problem_base_model(args, cfg, device) if args.word_problems else toy_run(args, cfg, folder, device)
    except KeyboardInterrupt:                          # one line: what is saved and how to go on
        phases = ["base"] if args.word_problems else PHASES
        saved = [p for p in phases if os.path.exists(os.path.join(folder, "checkpoints", f"{p}.pt"))]
        raise KeyboardInterrupt(f"{folder}/checkpoints holds {', '.join(saved) or 'no finished phase yet'}; "
                                f"run the same command again to continue from there") from None

def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    run = p.add_argument_group("run")
    run.add_argument("--out", default=None, help="output folder (default: runs/toy, or named after the "
                                                 "settings that differ from the default: runs/toy-quick)")
    run.add_argument("--quick", action="store_true", help="tiny model and few steps (for tests; about 10 seconds)")
    run.add_argument("--seed", type=count, default=0, help="seed for weights, data and layouts")
    run.add_argument("--restart", action="store_true", help="train every phase again, replacing the run in --out")
    run.add_argument("--device", default="auto",
                     help="auto (cuda if available), cpu, cuda or cuda:N; float32 on each")
    run.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads: the toy's "
                     "matrices are small; a 2nd slows steps 4-15x if another job uses a core")
    budget = p.add_argument_group("budget (override the defaults)")
    for flag, field, what in (("--teacher-steps", "teacher_steps", "next-token training steps of the teacher"),
                              ("--mtp-steps", "mtp_steps", "MTP training steps of each student"),
                              ("--n-eval", "n_eval", "held-out prompts per task, at most")):
        budget.add_argument(flag, type=positive_int, default=None,
                            help=f"{what} (default {getattr(RunConfig, field)}, --quick {QUICK[field]})")
    other = p.add_argument_group("other jobs")
    other.add_argument("--export-hf", default=None, metavar="DIR", help="only export the run "
                       "in --out (same settings): DIR/teacher, naive, distill in HF layout")
    other.add_argument("--word-problems", default=None, metavar="DIR", help="not the toy run: "
                       "write word-problem data to DIR/data, train a base model into DIR/base")
    args = p.parse_args(argv)
    if args.word_problems and (args.export_hf or args.out or args.mtp_steps or args.n_eval):
        raise CliError("--word-problems DIR trains the base model alone: --out, --export-hf, --mtp-steps "
                       "and --n-eval do not apply")
    return args

if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
