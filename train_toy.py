"""The method on a CPU in minutes: NTP teacher -> naive vs distilled MTP -> evaluation -> plots.

    python train_toy.py                     full run (about 8 minutes on 2 CPU cores)
    python train_toy.py --quick             smoke test (about 12 seconds)
    python train_toy.py --export-hf hf_toy  a finished run's models in Hugging Face layout

1. teacher: a small Llama-style transformer learns the five toy tasks of tasks/toy.py by
   next-token prediction
2. students: two copies with a `<mask>` token learn multi-token prediction on the same
   batches and layouts: "naive" against the true next k tokens, "distill" by
   student-forced self-distillation
3. evaluation: static k, ConfAdapt and lossless decoding -> OUT/results.json, a table,
   plots

OUT (runs/toy, runs/toy-quick, ...) is named after the settings and keeps them in
run_config.json; each phase is saved to OUT/checkpoints/ and resumed (--restart retrains).
mtp/toy_run.py keeps the folder and mtp/plots.py draws the figures.
The base model of finetune_hf.py's miniature GSM8K has its own script,
scripts/word_problem_base.py.
"""

import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

import data
from confadapt import DecodeConfig, decode_modes
from distill import frozen_teacher, mtp_loss
from model import ModelConfig, Transformer, add_mask_token
from mtp.cli import (CUDNN_ATTENTION, Parser, Progress, add_flags, apply_attention_backend,
                     count, format_seconds, output_folder, parse_device, positive_int,
                     provenance, run_cli)
from mtp.chunks import chunk_texts
from mtp.engine import generate
from mtp.hf import write_json
from mtp.plots import plot_chunks, plot_pareto, plot_training
from mtp.toy_run import (Phase, check_run_folder, checkpoint_path, export_hf, format_summary,
                         save_phase)
from tasks.toy import (TOY_SEQ_LEN, TOY_TASKS, check_toy, encode_example, heldout_examples,
                       toy_batch, toy_tokenizer)

# The phases, one checkpoint each, and their models' names in results.json
PHASES = ("teacher", "naive", "distill")
MODELS = ("ntp", "naive", "distill")
STUDENT_MODE = {"naive": "gt", "distill": "hard"}


@dataclass
class RunConfig:
    # the model
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    ffn_dim: int = 384

    # the data: tasks drawn uniformly; every toy sequence fits (repeat, the longest, is 21)
    tasks: tuple = TOY_TASKS
    seq_len: int = TOY_SEQ_LEN

    # phase 1, the teacher: next-token prediction
    batch_size: int = 32
    # with 2,000 steps the teacher of some seeds still fails a task
    teacher_steps: int = 3000
    teacher_lr: float = 4e-3

    # phase 2, the students: MTP, the same budget for both
    mtp_batch_size: int = 16
    # an MTP step costs 3-4x a teacher step
    mtp_steps: int = 700
    mtp_lr: float = 2e-3
    k_max: int = 8
    # = seq_len: every token ends a region (the paper's N / (2 k_max) is 1 here)
    n_regions: int = 21
    # next-token loss on the ground-truth answer tokens too
    prefix_ntp_weight: float = 1.0
    warmup_steps: int = 20
    weight_decay: float = 0.1

    # phase 3: prompts per task at most (count has 84, count_free 27)
    n_eval: int = 200
    static_ks: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    taus: tuple = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
    # answers are at most 13 items + <|eos|>
    max_new_tokens: int = 24
    seed: int = 0


# --quick: a tiny model, a few steps, a few prompts
QUICK = dict(dim=64, n_layers=2, ffn_dim=192, batch_size=16, teacher_steps=40,
             mtp_batch_size=8, mtp_steps=20, warmup_steps=5, n_eval=6,
             static_ks=(1, 4), taus=(0.5, 0.9), max_new_tokens=16)


# --- 1-2. Training: one loop for the teacher and both students -----------------------

def train_phase(name: str, model: Transformer, cfg: RunConfig, next_batch, device,
                mode: str | None = None, tokenizer=None,
                later_steps: int = 0) -> tuple[Transformer, list[dict]]:
    """AdamW -> (model in eval mode, log). mode None: next-token loss (cfg.teacher_*);
    "gt" or "hard": MTP (cfg.mtp_*; `tokenizer` knows <mask>). next_batch(rng, B) ->
    (seqs, answer). later_steps: the steps of the phases still to come, for the ETA."""
    student = mode is not None
    if student:
        steps = cfg.mtp_steps
        peak = cfg.mtp_lr
        batch_size = cfg.mtp_batch_size
    else:
        steps = cfg.teacher_steps
        peak = cfg.teacher_lr
        batch_size = cfg.batch_size

    # self-distillation learns from the student's start, frozen; "gt" needs no teacher
    teacher = None
    if student and mode != "gt":
        teacher = frozen_teacher(model)
    opt = model.configure_optimizer(peak, cfg.weight_decay)
    # the batches are the same for both students, and so are each step's k and offset
    rng = random.Random(cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    print(f"  {name}: {model.num_params() / 1e6:.2f}M parameters, "
          f"{model.config.vocab_size} tokens")

    model.train()
    log = []
    start = time.perf_counter()
    progress = Progress()
    for step in range(steps):
        # 1. the learning rate: linear warm-up, then cosine decay to 10% of the peak
        if step < cfg.warmup_steps:
            lr = peak * ((step + 1) / cfg.warmup_steps)
        else:
            decay = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
            lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * decay)))
        for group in opt.param_groups:
            group["lr"] = lr

        # 2. the batch and its loss
        seqs, answer = (t.to(device) for t in next_batch(rng, batch_size))   # (B, N)
        if student:
            # MTP problems (k in [2, k_max], region offset drawn afresh),
            # against the truth or the teacher
            batch = data.random_mtp_layout(
                seqs, k_max=cfg.k_max, n_regions=cfg.n_regions, trained=answer,
                mask_id=tokenizer.mask_id, eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id, generator=gen)
            loss, stats = mtp_loss(model, teacher, batch, mode=mode,
                                   prefix_ntp_weight=cfg.prefix_ntp_weight)
        else:
            # next-token cross-entropy on the answers (the prompts are random:
            # nothing to learn); -100 marks what is not trained
            logits = model(seqs[:, :-1]).float()                       # (B, N-1, V)
            targets = seqs[:, 1:].masked_fill(~answer[:, 1:], -100)    # (B, N-1)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                   ignore_index=-100)
            stats = {"loss": float(loss.detach())}

        # 3. backward, clip, update
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        # 4. the log; now and then a progress line. Its ETAs use this phase's own pace,
        # for the later phases' steps too: an MTP step costs 3-4x a teacher step, so the
        # run's estimate is low during the teacher and closer once the students start
        elapsed = time.perf_counter() - start
        log.append({**stats, "step": step, "seconds": elapsed, "lr": lr})
        done = step + 1
        if progress.due(last=done == steps):
            per_step = elapsed / done
            k = f" k {stats['k']}" if student else ""
            print(f"[{name}] step {done:4d}/{steps} | loss {stats['loss']:.4f}{k} | "
                  f"{done * seqs.numel() / elapsed:,.0f} tok/s | "
                  f"{format_seconds(elapsed)} | "
                  f"eta {format_seconds(per_step * (steps - done))}, "
                  f"run {format_seconds(per_step * (steps - done + later_steps))}",
                  flush=True)
    return model.eval(), log


def build_teacher(cfg: RunConfig, tokenizer, device) -> Transformer:
    """The teacher before training: tied embeddings, 128 positions."""
    torch.manual_seed(cfg.seed)
    mcfg = ModelConfig(vocab_size=tokenizer.n_vocab, dim=cfg.dim, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim,
                       max_seq_len=128, tie_embeddings=True,
                       bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    return Transformer(mcfg).to(device)


def student_from(teacher: Transformer, device) -> Transformer:
    """A trainable copy of the teacher with <mask> added, as `student_tokenizer` has it."""
    student = Transformer(replace(teacher.config))
    student.load_state_dict(teacher.state_dict())
    add_mask_token(student, toy_tokenizer())
    return student.to(device)


def student_tokenizer():
    """The toy tokenizer plus <mask> as its next id, where add_mask_token puts it."""
    tokenizer = toy_tokenizer()
    tokenizer.add_special_token("<mask>")
    return tokenizer


# --- 3. Evaluation: every model with every decoding setting on every task ------------

def sweep(cfg: RunConfig, multi_token: bool) -> list[DecodeConfig]:
    """The decoding settings; without <mask>, greedy only (called static k=1: the curve's
    start)."""
    if multi_token:
        modes = decode_modes(static_ks=cfg.static_ks, taus=cfg.taus, k_max=cfg.k_max,
                             lossless_k=cfg.k_max)
    else:
        modes = decode_modes(static_ks=(1,))
    return modes


def evaluate(models: dict, tokenizer, eval_sets: dict,
             cfg: RunConfig) -> tuple[list[dict], dict]:
    """One results row per (model, decoding, task) and one sample output each (the
    forward passes marked |)."""
    sweeps = {name: sweep(cfg, m.config.mask_token_id is not None)
              for name, m in models.items()}
    total = sum(map(len, eval_sets.values())) * sum(map(len, sweeps.values()))
    rows = []
    samples = {name: {} for name in models}
    done = 0
    start = time.perf_counter()
    progress = Progress()
    for name, model in models.items():
        for mode in sweeps[name]:
            for task, examples in eval_sets.items():
                row, sample = score(model, mode, task, examples, tokenizer, cfg)
                rows.append({"model": name, **row})
                # greedy is named static k=1 here: the curve's start
                setting = "static k=1" if mode.describe() == "greedy" else mode.describe()
                samples[name][f"{task} | {setting}"] = sample
                done += len(examples)
                if progress.due(last=done == total):
                    elapsed = time.perf_counter() - start
                    left = elapsed / done * (total - done)
                    print(f"[evaluation] {done:,}/{total:,} prompts x settings | "
                          f"{format_seconds(elapsed)} | eta {format_seconds(left)}",
                          flush=True)
    return rows, samples


def score(model, mode: DecodeConfig, task: str, examples: list, tokenizer,
          cfg: RunConfig) -> tuple[dict, str]:
    """One model, decoding setting and task: its results row (less the model's name) and
    the first prompt's output, each forward pass's tokens after a "|"."""
    prompts = [encode_example(tokenizer, ex)[0] for ex in examples]
    gens, stats = generate(model, prompts, cfg.max_new_tokens, mode=mode,
                           stop_ids=[tokenizer.eos_id])
    scores = []
    for ex, g in zip(examples, gens):
        # the answer: the tokens before <|eos|>, if it stopped
        tokens = g.tokens[:-1] if g.stopped else g.tokens
        scores.append(check_toy(task, ex.key, tokenizer.decode(tokens), g.stopped))

    n = len(scores)
    row = {"decode": mode.kind, "k": mode.block,
           "tau": mode.tau if mode.kind == "confadapt" else None,
           "task": task,
           "accuracy": sum(s.accuracy for s in scores) / n,
           "coherence": sum(s.coherence for s in scores) / n,
           "degeneration": sum(s.degenerate for s in scores) / n,
           "effective_k": stats.effective_k,
           "tokens_per_s": stats.tokens_per_second,
           # per prompt, on average
           "forward_passes": stats.row_passes / n,
           # batched: all n at once
           "batch_forward_passes": stats.forward_passes,
           "n_prompts": n}
    passes = chunk_texts(tokenizer, gens[0].tokens, gens[0].chunk_sizes)
    return row, examples[0].prompt + "".join(" |" + text for text in passes)


# The closing table, the README's claims, one row per task:
# (column, the results row it reads, its metrics)
SUMMARY = (
    ("teacher k=1", dict(model="ntp", decode="static", k=1), ("accuracy",)),
    ("naive k=4", dict(model="naive", decode="static", k=4),
     ("coherence", "degeneration")),
    ("distill k=4", dict(model="distill", decode="static", k=4),
     ("coherence", "degeneration")),
    ("naive tau=0.9", dict(model="naive", decode="confadapt", tau=0.9),
     ("accuracy", "effective_k")),
    ("distill tau=0.9", dict(model="distill", decode="confadapt", tau=0.9),
     ("accuracy", "effective_k")))


def summary(rows: list[dict]) -> dict:
    """{task: {"column: metric": value}} at full precision; format_summary rounds it."""
    tasks = sorted({r["task"] for r in rows}, key=TOY_TASKS.index)
    out = {task: {} for task in tasks}
    for task, values in out.items():
        for column, match, metrics in SUMMARY:
            found = [r for r in rows if r["task"] == task and r.items() >= match.items()]
            if found:
                values.update({f"{column}: {m}": found[0][m] for m in metrics})
    return out


# --- The run: 1. teacher, 2. students, 3. evaluation, 4. report ----------------------

def toy_run(args, cfg: RunConfig, out: str, device) -> dict:
    """Train (or load) the three models, evaluate them, report; return what results.json
    holds."""
    tokenizer = toy_tokenizer()
    # the students' tokenizer (the teacher just never meets <mask>)
    mask_tokenizer = student_tokenizer()
    batches = partial(toy_batch, tokenizer, tasks=cfg.tasks, seq_len=cfg.seq_len)
    done = {}
    if not args.restart:
        done = check_run_folder(out, cfg, PHASES)
    if args.export_hf:
        tokenizers = {"teacher": tokenizer, "naive": mask_tokenizer, "distill": mask_tokenizer}
        export_hf(args.export_hf, out, done, tokenizers)
        return {"export": args.export_hf, "models": list(MODELS)}
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "run_config.json"), asdict(cfg))

    t_start = time.perf_counter()
    budgets = zip(PHASES, (cfg.teacher_steps, cfg.mtp_steps, cfg.mtp_steps))
    left = {phase: steps for phase, steps in budgets if phase not in done}
    print(f"== {out}: {', '.join(left) or 'nothing'} to train, "
          f"{', '.join(done) or 'nothing'} loaded from checkpoints/")

    # 1. the teacher, from scratch; 2. the students, from the teacher: the same batches
    # and layouts, two losses. A phase found in checkpoints/ is loaded instead.
    for name in PHASES:
        if name in done:
            print(f"== {name}: loaded {checkpoint_path(out, name)} (trained in "
                  f"{done[name].seconds:.0f} s; --restart to retrain)")
            done[name].model.to(device)
            continue
        print(f"== {name}: training")
        start = time.perf_counter()
        if name == "teacher":
            model = build_teacher(cfg, tokenizer, device)
        else:
            model = student_from(done["teacher"].model, device)
        del left[name]
        model, log = train_phase(name, model, cfg, batches, device,
                                 mode=STUDENT_MODE.get(name), tokenizer=mask_tokenizer,
                                 later_steps=sum(left.values()))
        done[name] = Phase(model, log, time.perf_counter() - start)
        save_phase(out, name, done[name])

    # 3. evaluation
    models = {label: done[phase].model for label, phase in zip(MODELS, PHASES)}
    print(f"== evaluation on held-out prompts: {', '.join(models)}")
    t_eval = time.perf_counter()
    eval_sets = {task: heldout_examples(task, cfg.n_eval) for task in cfg.tasks}
    rows, samples = evaluate(models, mask_tokenizer, eval_sets, cfg)
    seconds = {phase: done[phase].seconds for phase in PHASES}
    seconds["evaluation"] = time.perf_counter() - t_eval
    print(f"== evaluation: {len(rows)} rows in {format_seconds(seconds['evaluation'])}")

    # 4. the report
    plot_pareto(rows, out)
    logs = {label: done[phase].log for label, phase in zip(MODELS, PHASES)}
    plot_training(logs, out)
    plot_chunks(models["distill"], mask_tokenizer, cfg, out)
    seconds["total"] = time.perf_counter() - t_start
    teacher = done["teacher"].model
    results = dict(rows=rows, summary=summary(rows), samples=samples, seconds=seconds,
                   device=str(device),
                   # commit, cpu, dtype, torch, threads
                   **provenance(next(teacher.parameters()).dtype),
                   n_params=teacher.num_params(), config=asdict(cfg), quick=args.quick)
    write_json(os.path.join(out, "results.json"), results)
    print(format_summary(results["summary"], SUMMARY))
    print(f"== done in {format_seconds(seconds['total'])}: {out}/results.json (every row, "
          f"full precision), pareto.png, training_curves.png, chunks.png")
    return results


# --- The command line ----------------------------------------------------------------

def default_out(args, cfg: RunConfig) -> str:
    """runs/toy, plus each setting that changes results: runs/toy-quick-seed1-teacher300."""
    base = RunConfig(**(QUICK if args.quick else {}))
    short = {"seed": "seed", "teacher_steps": "teacher", "mtp_steps": "mtp", "n_eval": "eval"}
    parts = [f"{s}{getattr(cfg, n)}" for n, s in short.items()
             if getattr(cfg, n) != getattr(base, n)]
    return os.path.join("runs", "-".join(["toy"] + ["quick"] * args.quick + parts))


def main(argv=None) -> dict:
    args = parse_args(argv)
    budget = {n: getattr(args, n) for n in ("teacher_steps", "mtp_steps", "n_eval")}
    given = {n: v for n, v in budget.items() if v is not None}
    preset = QUICK if args.quick else {}
    cfg = RunConfig(seed=args.seed, **{**preset, **given})
    device = parse_device(args.device)
    apply_attention_backend(args.cudnn_attention, device)
    torch.set_num_threads(args.threads)
    out = output_folder(args.out or default_out(args, cfg), "--out")
    try:
        return toy_run(args, cfg, out, device)
    except KeyboardInterrupt:
        # one line: what is saved and how to go on
        saved = [p for p in PHASES if os.path.exists(checkpoint_path(out, p))]
        raise KeyboardInterrupt(f"{out}/checkpoints holds "
                                f"{', '.join(saved) or 'no finished phase yet'}; "
                                f"run the same command again to continue from there") from None


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    run = p.add_argument_group("run")
    run.add_argument("--out", default=None,
                     help="output folder (default: runs/toy, or named after the settings "
                          "that differ from the default: runs/toy-quick)")
    run.add_argument("--quick", action="store_true",
                     help="tiny model and few steps: a smoke test, for tests")
    run.add_argument("--seed", type=count, default=0,
                     help="seed for weights, data and layouts")
    run.add_argument("--restart", action="store_true",
                     help="train every phase again, replacing the run in --out")
    run.add_argument("--device", default="auto",
                     help="auto (cuda if available), cpu, cuda or cuda:N; float32 on each")
    run.add_argument("--threads", type=positive_int, default=1,
                     help="torch CPU threads: the toy's matrices are small; a 2nd slows "
                          "steps 4-15x if another job uses a core")
    add_flags(run, CUDNN_ATTENTION)

    budget = p.add_argument_group("budget (override the defaults)")
    flags = (("--teacher-steps", "teacher_steps", "next-token training steps of the teacher"),
             ("--mtp-steps", "mtp_steps", "MTP training steps of each student"),
             ("--n-eval", "n_eval", "held-out prompts per task, at most"))
    for flag, field, what in flags:
        default = f"default {getattr(RunConfig, field)}, --quick {QUICK[field]}"
        budget.add_argument(flag, type=positive_int, default=None, help=f"{what} ({default})")

    other = p.add_argument_group("other jobs")
    other.add_argument("--export-hf", default=None, metavar="DIR",
                       help="only export the run in --out (same settings): DIR/teacher, "
                            "naive, distill in HF layout")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
