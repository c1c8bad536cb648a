"""Benchmark: what one cached decoding pass costs with the gated mask adapter, against the
untuned model's passes.

Speed-up is about tokens per pass divided by a pass's cost relative to greedy's, so the adapter's
pass price is half of what it gains. Three passes of batch 1 (or --batch-size) on top of the
same cached context, each timed as decoding runs it (mtp.engine.cached_forward, the model's own
Linear path with its adapter frozen):

    base, 1 token               the untuned model's greedy pass (use_adapter=False)
    base, k_max tokens          the same positions as the next pass, without the adapter
    adapter, 1 token + masks    a lossless or ConfAdapt pass: one token and k_max - 1 <mask>s

They take turns (A B C A B C ...), so that a busy moment of the machine slows all three alike;
each keeps the median of --repeats passes. Printed and written: each median in milliseconds and
the ratios, the adapter pass over the one-token base pass first (the cost a tuning run pays for).

    python benchmarks/adapter_pass.py --model ADAPTER_DIR --out DIR [--dtype bfloat16] [--threads 1]
    python benchmarks/adapter_pass.py --model BASE_DIR --rank 16 --targets wq wk wv wo --out DIR

The second form times an adapter that was never trained: a fresh one (adapter.add_mask_adapter,
`up` filled with small random values so that its update is not zero; the cost does not depend on
the values), saved and loaded as a trained folder is, to choose a rank and targets before a
tuning run. Writes adapter_pass.json and adapter_pass.md to --out.
"""
import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from adapter import (ADAPTER_TARGETS, add_mask_adapter, adapter_state,  # noqa: E402
                     is_adapter_folder, save_mask_adapter)
from model import add_mask_token  # noqa: E402
from mtp.cli import (CUDNN_ATTENTION, CliError, Parser, add_flags,  # noqa: E402
                     apply_attention_backend, base_folder, cpu_name, input_path, load_model,
                     number, output_folder, parse_device, parse_dtype, positive_int, provenance,
                     run_cli)
from mtp.engine import cached_forward, new_cache, synchronize  # noqa: E402
from mtp.hf import write_json, write_text  # noqa: E402

WRITES = ("adapter_pass.json", "adapter_pass.md")


def pass_shapes(k_max: int) -> dict:
    """The three passes by name: (ordinary tokens, <mask>s, adapter on)."""
    return {"base, 1 token": (1, 0, False),
            f"base, {k_max} tokens": (k_max, 0, False),
            f"adapter, 1 token + {k_max - 1} masks": (1, k_max - 1, True)}


@torch.inference_mode()
def pass_times(model, context: int, shapes: dict, repeats: int, batch_size: int = 1) -> dict:
    """{name: the seconds of each of `repeats` timed passes} for shapes {name: (ordinary tokens,
    <mask>s, adapter on)}: each a cached pass of batch_size rows over `context` cached tokens,
    predicting at every position it feeds, as a decoding pass does. The shapes take turns, one
    untimed round first (it warms up), and the cache rolls back after each pass."""
    device = next(model.parameters()).device
    mask_id = model.config.mask_token_id
    longest = max(n + m for n, m, _ in shapes.values())
    cache = new_cache(model, batch_size, context + longest)
    # ordinary tokens: any ids but <mask>'s
    ordinary = [t for t in range(context + longest + 1) if t != mask_id]
    base = functools.partial(model, use_adapter=False)
    filler = [ordinary[:context]] * batch_size                           # (B, context)
    cached_forward(base, filler, cache, output_index=[[context - 1]] * batch_size)
    passes = {}
    for name, (n, masks, on) in shapes.items():
        tokens = [ordinary[context:context + n] + [mask_id] * masks] * batch_size   # (B, n + masks)
        places = [list(range(n + masks))] * batch_size
        passes[name] = (model if on else base, tokens, places)
    times = {name: [] for name in shapes}
    for round_ in range(repeats + 1):
        for name, (forward, tokens, places) in passes.items():
            synchronize(device)
            t0 = time.perf_counter()
            cached_forward(forward, tokens, cache, output_index=places)
            synchronize(device)
            if round_ > 0:
                times[name].append(time.perf_counter() - t0)
            cache.rollback(context)
    return times


def fresh_adapter_folder(base: str, folder, rank: int, alpha: float, targets, seed: int = 0):
    """Write into `folder` a gated mask adapter on `base` that was never trained: add_mask_adapter's
    (seeded), with `up` drawn small instead of zero, so that its update is not zero."""
    model, tok, _, _ = load_model(base)
    add_mask_token(model, tok)
    add_mask_adapter(model, rank, alpha, targets, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in adapter_state(model).items():
            if name.endswith(".up"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.01)
    save_mask_adapter(model, folder, base)


def measure(args, folder) -> dict:
    device = parse_device(args.device)
    apply_attention_backend(args.cudnn_attention, device)
    dtype = parse_dtype(args.dtype, device)
    model = load_model(folder, device, dtype, args.base)[0]
    shapes = pass_shapes(args.k_max)
    print(f"timing {len(shapes)} passes, {args.repeats} rounds", file=sys.stderr, flush=True)
    times = pass_times(model, args.context, shapes, args.repeats, args.batch_size)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    base_one, base_k, adapter = shapes
    pairs = {f"{adapter} / {base_one}": (adapter, base_one),
             f"{base_k} / {base_one}": (base_k, base_one),
             f"{adapter} / {base_k}": (adapter, base_k)}
    ratios = {key: ms[a] / ms[b] for key, (a, b) in pairs.items()}
    # the median of each round's own ratio: the passes of one round share the machine's moment
    paired = {key: statistics.median(x / y for x, y in zip(times[a], times[b]))
              for key, (a, b) in pairs.items()}
    config = model.adapter_config
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    meta = {"model": args.model, "machine": machine, **provenance(dtype, device),
            "adapter": {**config, "fresh": args.rank is not None,
                        "parameters": sum(t.numel() for t in adapter_state(model).values())},
            "context": args.context, "k_max": args.k_max, "batch_size": args.batch_size,
            "repeats": args.repeats}
    return {"meta": meta, "ms": ms, "ratios": ratios, "paired_ratios": paired,
            "seconds": times}


def markdown(report: dict) -> str:
    m = report["meta"]
    a = m["adapter"]
    trained = "a fresh, untrained" if a["fresh"] else "a trained"
    lines = [f"### One cached pass of {m['model']} with {trained} gated mask adapter", "",
             f"{m['machine']}, {m['device']}, {m['dtype']}, {m['threads']} threads; batch "
             f"{m['batch_size']}, {m['context']} cached tokens; adapter rank {a['rank']} on "
             f"{', '.join(a['targets'])} ({a['parameters']:,} parameters); median of "
             f"{m['repeats']} passes each, taking turns.", "",
             "| pass | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in report["ms"].items()]
    lines += ["", "| ratio | of medians | median of each round's |", "|---|---|---|"]
    lines += [f"| {key} | {r:.3f}x | {report['paired_ratios'][key]:.3f}x |"
              for key, r in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def check_args(args):
    """Before any weights: what the command line asks for can be done."""
    input_path(args.model, "--model", folder=True)
    # an adapter's base: there, and the one it was trained on
    base_folder(args.model, args.base)
    adapter = is_adapter_folder(args.model)
    if adapter and args.rank is not None:
        raise CliError(f"--rank builds a fresh adapter on a base model folder; --model "
                       f"{args.model} is an adapter folder already (leave --rank out)")
    if not adapter and args.rank is None:
        raise CliError(f"--model {args.model} is not a gated mask adapter folder (no "
                       "mask_adapter.json): give --rank (and --targets) to time a fresh one")
    if args.rank is None and (args.targets or args.alpha):
        raise CliError("--targets and --alpha go with --rank (a fresh adapter)")
    out = Path(output_folder(args.out, "--out"))
    there = [name for name in WRITES if (out / name).exists()]
    if there and not args.overwrite:
        raise CliError(f"--out {out} holds {there[0]} already: add --overwrite to replace it")


def adapter_pass_main(argv):
    p = Parser(prog="adapter_pass.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a gated mask adapter folder, or with --rank its base model folder")
    p.add_argument("--base", help="an adapter folder's base model, if not where it says")
    p.add_argument("--out", required=True, help="folder for adapter_pass.json and .md")
    p.add_argument("--overwrite", action="store_true",
                   help="replace this script's earlier output in --out")
    add_flags(p,
              ("--rank", positive_int, None, "time a fresh adapter of this rank on --model (a "
               "base model folder) instead of a trained one"),
              ("--targets", None, None, f"the fresh adapter's projections (default: all of "
               f"{', '.join(ADAPTER_TARGETS)})", {"nargs": "+", "choices": ADAPTER_TARGETS}),
              ("--alpha", number(float, 0, low_open=True), None,
               "the fresh adapter's alpha (default 2 x rank; the cost does not depend on it)"),
              ("--k-max", number(int, 2), 4, "tokens a pass feeds: 1 token + k_max - 1 masks"),
              ("--context", positive_int, 160, "cached tokens under each pass"),
              ("--repeats", positive_int, 30, "timed rounds; each pass keeps its median"),
              ("--batch-size", positive_int, 1, "rows of each pass"),
              ("--device", None, "auto", "auto (cuda if available), cpu, cuda, cuda:1, ..."),
              ("--dtype", None, "auto", "auto: bfloat16 where the hardware computes it natively, "
               "else float32", {"choices": ("auto", "float32", "bfloat16")}),
              ("--threads", positive_int, None, "CPU threads for torch (default: torch's choice)"),
              CUDNN_ATTENTION)
    args = p.parse_args(argv)
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rank is None:
        report = measure(args, args.model)
    else:
        with tempfile.TemporaryDirectory() as folder:
            fresh_adapter_folder(args.model, folder, args.rank, args.alpha or 2.0 * args.rank,
                                 args.targets or ADAPTER_TARGETS)
            report = measure(args, folder)
    text = markdown(report)
    print(text, end="")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "adapter_pass.json", report)
    write_text(out / "adapter_pass.md", text)


def main(argv=None) -> int:
    return run_cli(adapter_pass_main, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
