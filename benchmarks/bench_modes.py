"""Benchmark: greedy, static k, ConfAdapt and lossless decoding of one model, timed side by side.

Every mode decodes the same rows at every batch size (mtp.engine.generate with continuous
batching); then the latency curve of one cached pass of T = 1..N new tokens per row, which says
how much of a mode's effective k (fewer passes) can become wall-clock speed-up.

    python benchmarks/bench_modes.py --model DIR --prompt "..." [--prompt "..."] [--json]

benchmarks/decode_real.py runs the same harness on a real model against transformers' generate.
"""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp.cli import (Parser, add_flags, add_model_args, chat_stop_ids, check_model_folder,  # noqa: E402
                     encode_prompt, load, positive_int, probability, prompt_format, run_cli)
from confadapt import DecodeConfig, decode_modes  # noqa: E402
from mtp.engine import cached_forward, generate, new_cache, synchronize  # noqa: E402


@torch.inference_mode()
def forward_latency(model, batch_size: int, context: int, sizes, repeats: int = 5) -> dict:
    """Median seconds of one cached pass of T new tokens per row, on top of `context` cached tokens.

    This is the price list of multi-token decoding: if a 31-token pass costs about what a 1-token
    pass costs (memory-bound decoding), effective k turns into wall-clock speed-up almost 1:1.
    """
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    cache = new_cache(model, batch_size, context + max(sizes))
    filler = torch.arange(batch_size * context, device=device).view(batch_size, context) % vocab  # (B, context)
    cached_forward(model, filler, cache, output_index=torch.zeros(batch_size, 1, dtype=torch.long, device=device))
    out = {}
    for T in sizes:
        tokens = torch.arange(T, device=device).expand(batch_size, T) % vocab        # (B, T)
        times = []
        for i in range(repeats + 1):                                                  # run 0 warms up
            synchronize(device)
            t0 = time.perf_counter()
            cached_forward(model, tokens, cache, output_index=tokens.new_tensor(range(T)).expand(batch_size, T))
            synchronize(device)
            if i > 0:
                times.append(time.perf_counter() - t0)
            cache.rollback(context)
        out[T] = statistics.median(times)
    return out


def bench(model, prompts: list[list[int]], max_new_tokens: int, modes: list[DecodeConfig],
          batch_sizes=(1, 4, 16), mask_id=None, stop_ids=(), repeats: int = 3, latency_sizes=range(1, 33),
          n_rows: int | None = None, others: dict | None = None, outputs: dict | None = None) -> dict:
    """Time every mode at every batch size on the same workload.

    The workload is the prompts cycled up to n_rows rows (default: as many as the prompts or the
    largest batch size); batch size b decodes it b rows at a time, a finished row's place going
    to the next waiting one (generate's continuous batching), so every batch size and mode
    decodes the same rows. The modes take turns, `repeats` rounds, and each keeps
    its fastest round (decoding is deterministic, so only the time varies; taking turns spreads
    a busy moment of the machine over all modes instead of one).
    Tokens/second counts decoding time (prefill excluded, as in DecodeStats); speed-up is over
    greedy at the same batch size; efficiency = speed-up / effective k, the share of the saved
    passes that became saved time. "Fed per token" is the positions the passes computed per
    generated token (greedy: 1): where a pass's cost grows with its positions (the latency
    curve), this is what a multi-token mode pays for its fewer passes. "Equals greedy": the
    mode's tokens are greedy's, row for row (what the lossless mode promises).

    `others` adds decoders from elsewhere to the turns (benchmarks/ passes transformers'
    `generate` here): {name: decode(rows, max_new_tokens, batch_size) -> (list[Generation],
    DecodeStats), or None at a batch size it does not support}. `outputs`, a dict, gets each
    timed run's Generations: outputs[batch_size, mode name].
    """
    n_rows = n_rows or max(len(prompts), max(batch_sizes))
    rows = [prompts[i % len(prompts)] for i in range(n_rows)]
    # each decoder: (its name, its kind (greedy is static k=1), decode)
    decoders = [(m.describe(), "greedy" if m.describe() == "greedy" else m.kind,
                 lambda r, n, bs, m=m: generate(model, r, n, m, mask_id, stop_ids, batch_size=bs))
                for m in modes] + [(name, name, fn) for name, fn in (others or {}).items()]
    results, latency = [], {}
    outputs = {} if outputs is None else outputs
    for bs in batch_sizes:
        # Warm-up (allocator, kernels); a decoder that answers None does not take this batch size.
        here = [d for d in decoders if d[2](rows[:bs], min(8, max_new_tokens), bs) is not None]
        rounds = [[decode(rows, max_new_tokens, bs) for _, _, decode in here]
                  for _ in range(repeats)]                                   # rounds[r][m]: (gens, DecodeStats)

        def decoding_seconds(run):                                  # prefill excluded
            return run[1].seconds - run[1].prefill_seconds

        greedy = greedy_tps = None
        for m, (name, kind, _) in enumerate(here):
            gens, best = min((r[m] for r in rounds), key=decoding_seconds)
            tokens, row_passes, seconds = best.tokens, best.row_passes, decoding_seconds((gens, best))
            tps = tokens / max(seconds, 1e-9)
            if kind == "greedy":
                greedy, greedy_tps = [g.tokens for g in gens], tps
            speedup = tps / greedy_tps if greedy_tps else float("nan")
            effective_k = tokens / max(1, row_passes)
            results.append({"batch_size": bs, "mode": name, "kind": kind, "tokens": tokens,
                            "forward_passes": best.forward_passes, "effective_k": effective_k,
                            "fed_per_token": best.fed_tokens / max(1, tokens),
                            "tokens_per_second": tps, "seconds": seconds,
                            "speedup": speedup, "efficiency": speedup / effective_k,
                            "equals_greedy": None if greedy is None else [g.tokens for g in gens] == greedy,
                            "accept_hist": best.accept_hist})
            outputs[bs, name] = gens
        if latency_sizes:
            context = max(len(p) for p in rows) + max_new_tokens // 2
            latency[bs] = forward_latency(model, bs, context, list(latency_sizes))
    return {"results": results, "latency_seconds": latency}


def format_bench(report: dict) -> str:
    lines = [f"{'batch':>5}  {'mode':<28} {'tokens/s':>10} {'eff. k':>7} {'speed-up':>9} "
             f"{'efficiency':>10} {'passes':>7} {'fed/token':>9} {'= greedy':>8}"]
    for r in report["results"]:
        lines.append(f"{r['batch_size']:>5}  {r['mode']:<28} {r['tokens_per_second']:>10.1f} {r['effective_k']:>7.2f} "
                     f"{r['speedup']:>8.2f}x {r['efficiency']:>10.2f} {r['forward_passes']:>7} "
                     f"{r['fed_per_token']:>9.2f} {'yes' if r['equals_greedy'] else 'no':>8}")
    lines.append("")
    lines.append("forward-pass latency (ms) for T new tokens per row on a filled cache; ratio to T = 1")
    for bs, curve in report["latency_seconds"].items():
        base = curve[min(curve)]
        cells = "  ".join(f"T={T}: {s * 1e3:.2f} ({s / base:.2f}x)" for T, s in curve.items()
                          if T in (1, 2, 4, 8, 16, 24, 32) or T == max(curve))
        lines.append(f"batch {bs:>3}: {cells}")
    return "\n".join(lines)


def bench_main(argv):
    p = Parser(prog="bench_modes.py", description="Time greedy, static k, ConfAdapt and lossless decoding.")
    add_model_args(p)
    b = p.add_argument_group("benchmark")
    b.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for several; batches cycle through them)")
    add_flags(b,
              ("--max-new-tokens", positive_int, 128, "most tokens per prompt"),
              ("--batch-sizes", positive_int, [1, 4, 16], "batch sizes to time", {"nargs": "+"}),
              ("--static-k", positive_int, 4, "static k to time"),
              ("--taus", probability, [0.5, 0.7, 0.8, 0.9, 0.95, 0.99], "ConfAdapt thresholds",
               {"nargs": "+"}),
              ("--k-max", positive_int, [16], "ConfAdapt: most tokens per pass (several: a sweep)",
               {"nargs": "+"}),
              ("--lossless-k", positive_int, None,
               "lossless: most tokens per pass (default: the largest --k-max)"),
              ("--rows", positive_int, None, "rows in the workload, the prompts cycled "
               "(default: the number of prompts or the largest batch)"),
              ("--repeats", positive_int, 3, "rounds over all modes; each mode keeps its fastest"),
              ("--latency-max", positive_int, 32, "latency curve for 1..N new tokens per pass"))
    b.add_argument("--ignore-stop", action="store_true", help="always generate --max-new-tokens tokens")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    # the format against the tokenizer, before any weights (--k-max stays as given)
    check_model_folder(args, k_max_applies=False)

    # decode_modes validates each
    modes = [DecodeConfig("static", k=1), *decode_modes([args.static_k])]
    modes += [m for k in args.k_max for m in decode_modes(taus=args.taus, k_max=k)]
    modes += decode_modes(lossless_k=args.lossless_k or max(args.k_max))
    model, tokenizer, mask_id, stop_ids = load(args, modes[1])
    fmt = prompt_format(args.format, tokenizer, model)
    stop_ids = chat_stop_ids(stop_ids, tokenizer, fmt)
    prompts = [encode_prompt(tokenizer, model, t, fmt, args.no_bos) for t in args.prompt]
    report = bench(model, prompts, args.max_new_tokens, modes, args.batch_sizes, mask_id,
                   () if args.ignore_stop else stop_ids, args.repeats, range(1, args.latency_max + 1), args.rows)
    dtype = str(model.tok_emb.weight.dtype).removeprefix("torch.")       # what --dtype resolved to
    report.update(model=args.model, device=args.device, dtype=dtype,
                  max_new_tokens=args.max_new_tokens,
                  prompt_tokens=[len(x) for x in prompts])
    print(json.dumps(report) if args.json else format_bench(report))


def main(argv=None) -> int:
    return run_cli(bench_main, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
