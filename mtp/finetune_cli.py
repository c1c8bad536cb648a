"""finetune_hf.py's command line: its six commands' flags, the checks made before
any work, and the dispatch to the command; not part of the method, a learner can
skip it.

A mistake in a flag or a path ends in one line `error: ...` before any model is
loaded (mtp.cli.run_cli prints it). The eval, analyze and export commands write
into a new or empty folder, or with --overwrite over their own earlier output,
never into a model folder or a training run they did not write.
"""

import argparse
import os
import warnings
from functools import partial
from pathlib import Path

import torch

from mtp.tokenizer import default_format, end_token, FORMATS
from tasks.word_problems import DOMAINS
from distill import LOSSES
from adapter import ADAPTER_CONFIG, ADAPTER_TARGETS, is_adapter_folder
from mtp.calibration import CALIBRATION
from mtp.hf import read_json, read_model_config
from mtp.cli import (CUDNN_ATTENTION, CliError, Parser, add_calibration_flag, add_flags,
                     apply_attention_backend, base_folder, check_model_folder, count,
                     input_path, load_model, number, output_folder, parse_device, parse_dtype,
                     positive_float, positive_int, probability, run_cli)
from mtp.distributed import end_worker
from mtp.folders import FolderLock

DESCRIPTION = ("Fine-tune a Hugging Face Llama/Qwen/SmolLM2 checkpoint into a multi-token "
               "predictor; measure it.")

# What each command writes into its --out folder; a folder holding anything
# else is not its own.
WRITES = {"eval": ("results.json", "results.md", "pareto.png", "samples.jsonl"),
          "analyze": ("analysis.json", "analysis.md")}

# train's adapter-only flags, unset (None) unless given, and their defaults.
ADAPTER_DEFAULTS = {"adapter_rank": 32, "adapter_alpha": 64.0,
                    "adapter_targets": list(ADAPTER_TARGETS), "adapter_slot_embeddings": False}

# In the model card of every export: export writes only over a folder whose
# card has it.
MODEL_CARD_TAGS = "tags: [multi-token-prediction, self-distillation]"


def run_commands(commands: dict, argv) -> int:
    """The command line's exit status: 0, or after one line `error: ...` 2 (mtp.cli.run_cli).
    A torchrun worker ends here, at once (mtp.distributed.end_worker)."""
    code = run_cli(partial(run_command, commands), argv)
    if "WORLD_SIZE" in os.environ:
        end_worker(code)
    return code


def run_command(commands: dict, argv):
    """Parse `argv`, check it, run its command (`commands` maps each name to its
    function); under torchrun the process group ends however the command ends."""
    args = build_parser().parse_args(argv)
    # Checkpoints (torch.distributed.checkpoint) warn about this on one process.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.threads:
        torch.set_num_threads(args.threads)
    # the --out folder's lock, held from the checks to the command's end
    locks = []
    try:
        check_args(args, locks)
        for held in locks:
            held.acquire()
        if args.command != "export":
            apply_attention_backend(args.cudnn_attention, parse_device(args.device))
        commands[args.command](args)
    finally:
        for lock in locks:
            lock.release()
        if "WORLD_SIZE" in os.environ and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="finetune_hf.py", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    taus = [0.99, 0.95, 0.9, 0.8, 0.7, 0.5]

    # All commands but export; max_new_tokens: the decoding ones (not train).
    def common(c, model_help, max_new_tokens=None):
        c.add_argument("--model", required=True,
                       help=f"Hugging Face layout folder{model_help}")
        c.add_argument("--base", help="a gated mask adapter's base model folder, if not "
                       "where its mask_adapter.json says (checked against its fingerprint)")
        c.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                       help="prompt format (auto: the folder's trained format, else the "
                       "tokenizer's chat format, else plain)")
        if max_new_tokens:
            add_flags(c,
                      ("--max-new-tokens", positive_int, max_new_tokens,
                       "most tokens of each answer (data: a cut answer is marked unfinished)"),
                      ("--batch-size", positive_int, 16, "prompts per batch"))
        c.add_argument("--device", default="auto",
                       help="auto (cuda if any), cpu, cuda or cuda:N")
        c.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="compute dtype; auto (the default): bfloat16 where the hardware "
                       "computes it natively (a GPU from Ampere on, a CPU with AVX-512 BF16 or "
                       "AMX), else float32")
        c.add_argument("--threads", type=positive_int,
                       help="CPU threads (default: one per core)")
        add_flags(c, CUDNN_ATTENTION)
        if max_new_tokens:
            add_calibration_flag(c)

    t = sub.add_parser("train",
                       help="MTP fine-tuning by self-distillation (torchrun: multi-GPU)")
    common(t, " (config.json, safetensors, tokenizer)")
    g = t.add_argument_group("data")
    g.add_argument("--data", required=True, nargs="+",
                   help="rows (query or prompt, response): JSON array or JSONL")
    add_flags(g,
              ("--seq-len", number(int, 2), 160, "tokens per sequence"),
              ("--limit-rows", count, 0, "use only the first N rows (0: all)"))
    g.add_argument("--response-only", action="store_true",
                   help="predict response tokens only (the paper: all)")
    o = t.add_argument_group("optimization (defaults: the paper's full-scale recipe)")
    add_flags(o,
              ("--steps", positive_int, 100_000, "optimizer steps"),
              ("--batch-size", positive_int, 128, "per step, all processes"),
              ("--micro-batch", positive_int, 8, "per forward pass and process"),
              ("--lr", positive_float, 1e-5, "peak learning rate (AdamW)"),
              ("--warmup", count, 2000, "linear warm-up steps"),
              ("--decay", count, 0, "lr linearly to 0 over the last N steps (the paper: 0)"),
              ("--weight-decay", number(float, 0), 0.1, "AdamW weight decay"),
              ("--beta1", number(float, 0, 0.9999), 0.9, "AdamW beta1"),
              ("--beta2", number(float, 0, 0.9999), 0.95, "AdamW beta2"),
              ("--clip", positive_float, 1.0, "gradient norm clipping"),
              ("--seed", count, 0, "data order and every step's k and offset"))
    m = t.add_argument_group("multi-token prediction")
    add_flags(m,
              ("--mode", None, "hard", "hard / soft: self-distillation; gt: naive ablation",
               {"choices": LOSSES}),
              ("--k-max", number(int, 2), 16, "k is drawn uniformly from [2, k_max] every step"),
              ("--regions", positive_int, None,
               "MTP problems per sequence (default seq_len / (2 k_max))"),
              ("--prefix-ntp-weight", number(float, 0), 0.0, "plus this much plain NTP loss"),
              ("--adapter", None, "none",
               "none (the default, the paper's recipe): tune every weight against a frozen "
               "copy; gated-lora: freeze the model and train a low-rank update that acts only "
               "at <mask> positions (the model's own predictions stay exactly the base "
               "model's; the teacher is the base itself, no copy); final/ then holds the "
               "adapter, not a model", {"choices": ("none", "gated-lora")}),
              ("--adapter-rank", positive_int, None, "gated-lora: rank of each update "
               "(default 32)"),
              ("--adapter-alpha", positive_float, None,
               "gated-lora: the update is scaled by alpha / rank (default 64)"),
              ("--adapter-targets", None, None,
               "gated-lora: the projections that get an update (default: all)",
               {"nargs": "+", "choices": ADAPTER_TARGETS}),
              ("--shard-base", None, "auto",
               "gated-lora under torchrun: yes shards the frozen base over the processes "
               "(FSDP2); no keeps it whole on each, in the compute dtype, and averages only the "
               "adapter's gradients (one all-reduce a step); auto (the default): no where it "
               "fits, its memory as benchmarks/memory.py counts it under 80%% of the GPU's, "
               "and always on a CPU. A full fine-tune is always sharded",
               {"choices": ("auto", "yes", "no")}))
    m.add_argument("--adapter-slot-embeddings", action="store_const", const=True,
                   help="gated-lora: one <mask> embedding per slot (k_max - 1 of them), each "
                   "knowing how far ahead it guesses, instead of one shared")
    c = t.add_argument_group("checkpoints")
    c.add_argument("--out", required=True,
                   help="output folder: checkpoints/, log.jsonl, final/ (the exported model)")
    add_flags(c,
              ("--save-every", positive_int, 1000, "checkpoint every N steps"),
              ("--keep", positive_int, 2, "checkpoints to keep"))
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
    add_flags(e,
              ("--prompt-style", None, "fewshot",
               "fewshot: lm-eval gsm8k_cot; zeroshot: the question in the training format "
               "(small models)", {"choices": ("fewshot", "zeroshot")}),
              ("--n-shot", number(int, 0, 8), 8, "fewshot: exemplars before the question"),
              ("--static-k", positive_int, [1, 2, 3, 4], "static k values (1: greedy)",
               {"nargs": "*"}),
              ("--taus", probability, taus, "ConfAdapt thresholds, each in (0, 1]",
               {"nargs": "*"}),
              ("--k-max", positive_int, None,
               "ConfAdapt: most tokens per pass (default: the folder's trained k_max, else 16)"),
              ("--lossless-k", count, 0, "also run the lossless mode with this k (0: no; "
               "exact in float32, up to rounding in bfloat16)"),
              ("--limit", count, 0, "first N questions only (0: all)"))
    e.add_argument("--reference",
                   help="an earlier eval's --out: report how often each answer equals its "
                   "k=1 answer")
    e.add_argument("--tolerance", type=number(float, 0), metavar="POINTS",
                   help="name the tau with the most tokens per pass whose accuracy "
                   "(flexible-extract) is at most POINTS below k=1's (--reference's, else "
                   "this model's), question by question: its drop plus two standard errors "
                   "of the paired difference is within POINTS; none if no tau's is (the "
                   "tolerance is inside the noise)")

    a = sub.add_parser("analyze",
                       help="before tuning: how predictable are the model's answers on this "
                       "domain?")
    common(a, ": the base model, before tuning", 256)
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="the domain's prompts: rows with question, query or prompt")
    src.add_argument("--domains", nargs="+", choices=DOMAINS,
                     help="held-out prompts generated in code, per domain")
    add_flags(a,
              ("--limit", count, 64, "first N prompts only (0: all)"),
              ("--taus", probability, taus, "ConfAdapt thresholds, each in (0, 1]",
               {"nargs": "+"}),
              ("--k-max", number(int, 2), 16, "most tokens per pass"))
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
    add_flags(r,
              ("--domains", None, list(DOMAINS), "domains", {"nargs": "+", "choices": DOMAINS}),
              ("--per-domain", positive_int, 100, "prompts per domain (fewer if it has fewer)"),
              ("--split", None, "train", "prompt split", {"choices": ("train", "test")}))

    cal = sub.add_parser("calibrate",
                         help="a gated mask adapter: fit one temperature per mask slot on "
                         "held-out rows, so that ConfAdapt's confidences match how often its "
                         "guesses are right; written into the adapter's folder")
    common(cal, ": a gated mask adapter's folder (its mask_adapter.json gets the temperatures)")
    cal.add_argument("--data", required=True, nargs="+",
                     help="held-out rows (query or prompt, response), as train reads them: "
                     "rows it did not train on (data --split test, say)")
    cal.add_argument("--check", nargs="+",
                     help="more held-out rows, not fitted on (all of them): the ECE the "
                     "temperatures give there too, stored beside the fit")
    add_flags(cal,
              ("--limit-rows", count, 0, "use only the first N rows (0: all)"),
              ("--seq-len", number(int, 2), 160, "tokens per row, as in train"),
              ("--k-max", number(int, 2), None,
               "mask slots + 1 to calibrate (default: the folder's trained k_max, else 16); "
               "a pass with more slots gives the extra ones the last slot's temperature"),
              ("--batch-size", positive_int, 8, "rows per forward pass"))
    cal.add_argument("--force", action="store_true",
                     help="replace the calibration the folder holds")

    x = sub.add_parser("export", help="a training checkpoint -> a Hugging Face folder")
    x.add_argument("--checkpoint", required=True,
                   help="a run's --out folder or one checkpoints/step_N folder")
    x.add_argument("--out", required=True,
                   help="the Hugging Face folder to write: new or empty")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out")
    x.add_argument("--threads", type=positive_int, help="CPU threads (default: one per core)")
    return p


def check_args(args, locks):
    """Before any work: what a command reads exists, what it writes can be made;
    train's sizes. Appends to `locks` the lock of the folder it writes into."""
    # export has --checkpoint, no --model or --data.
    a = vars(args)
    for flag in ("model", "checkpoint"):
        if a.get(flag) is not None:
            input_path(a[flag], f"--{flag}", folder=True)
    # The model's config says most about a wrong folder.
    cfg = read_model_config(base_folder(args.model, args.base)) if "model" in a else None
    if "model" in a:
        check_model_folder(args, raw=False, k_max_applies=args.command in ("eval", "calibrate"),
                           defaults=args.command != "train")
    if args.command in ("eval", "calibrate"):
        args.k_max = args.k_max or 16
    if args.command == "calibrate":
        check_calibrate(args, cfg)
    # One file (eval, analyze) or several (train).
    data = a.get("data")
    if isinstance(data, str):
        data = [data]
    for path in data or []:
        input_path(path, "--data")
    # An earlier eval's --out.
    if a.get("reference") is not None:
        input_path(os.path.join(args.reference, "samples.jsonl"), "--reference")
    if a.get("tolerance") is not None and not args.reference and 1 not in args.static_k:
        raise CliError("--tolerance compares with k=1's accuracy: add 1 to --static-k, or "
                       "give --reference")
    # data's --out is a file.
    if args.command == "data":
        if os.path.isdir(args.out):
            raise CliError(f"--out {args.out}: is a folder, expected a file name")
        output_folder(os.path.dirname(args.out) or ".", f"--out {args.out}: its folder")
        lock(args, os.path.dirname(args.out) or ".", locks)
        if os.path.exists(args.out) and not args.overwrite:
            raise CliError(f"--out {args.out} exists: add --overwrite to replace it")
    elif a.get("out") is not None:
        output_folder(args.out, "--out")
        lock(args, args.out, locks)
        check_out_folder(args)
    if args.command != "train":
        return
    check_adapter_flags(args)

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
    if args.adapter == "none" and args.shard_base == "no":
        raise CliError("--shard-base no keeps the gated adapter's frozen base whole on every "
                       "process; a full fine-tune trains every weight and is always sharded")
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


def check_calibrate(args, cfg):
    """calibrate writes into a gated mask adapter's folder, and over an earlier
    calibration only with --force."""
    if not is_adapter_folder(args.model):
        raise CliError(f"--model {args.model} is not a gated mask adapter's folder (no "
                       "mask_adapter.json): calibrate fits an adapter's mask predictions")
    if CALIBRATION in read_json(os.path.join(args.model, ADAPTER_CONFIG), "mask adapter config"):
        if not args.force:
            raise CliError(f"--model {args.model} is calibrated already (mask_adapter.json "
                           "holds a calibration): add --force to replace it")
    if args.seq_len + args.k_max - 2 >= cfg.max_seq_len:
        raise CliError(f"--seq-len {args.seq_len} with --k-max {args.k_max} needs positions "
                       f"beyond the model's {cfg.max_seq_len}")
    for path in args.check or []:
        input_path(path, "--check")


def lock(args, folder, locks):
    """`folder`'s lock, into `locks`: held now if the folder exists (a run in it is
    told before any other check), else once every check has passed (run_command),
    so that a refused command makes no folder."""
    name = f"--out {args.out}" + (f": its folder {folder}" if folder != args.out else "")
    held = FolderLock(folder, name)
    locks.append(held)
    if os.path.isdir(folder):
        held.acquire()


def check_adapter_flags(args):
    """train's adapter-only flags need --adapter gated-lora; unset, their defaults."""
    given = [k for k in ADAPTER_DEFAULTS if getattr(args, k) is not None]
    if given and args.adapter == "none":
        flag = "--" + given[0].replace("_", "-")
        raise CliError(f"{flag} applies to --adapter gated-lora only; without it train "
                       "tunes every weight: add --adapter gated-lora, or leave it out")
    for key, value in ADAPTER_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


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



def model_name(path):
    """A model folder's last two path parts, as titles name it."""
    return "/".join(Path(path).resolve().parts[-2:])


def load_for_inference(args):
    """(model, tokenizer, mask id or None, prompt format, stop ids) of --model,
    for the commands that decode (eval, analyze, data)."""
    device = parse_device(args.device)
    model, tok, mask_id, stop_ids = load_model(args.model, device,
                                               parse_dtype(args.dtype, device), args.base,
                                               not getattr(args, "no_calibration", False))
    fmt = args.format
    if fmt == "auto":
        fmt = default_format(tok, model.config.model_type)
    # The format's end of turn stops decoding too.
    return model, tok, mask_id, fmt, stop_ids | {end_token(tok, fmt)}
