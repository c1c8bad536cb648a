"""Benchmark: what the shape of one decoding pass costs, the two facts serve.py's rule prices.

1. Tiles. A layer's matrix product (SmolLM2's 1536 x 576 MLP weight, 60 copies read in turn so
   the weights come from memory as in a pass) for M = 1 .. 128 positions: matrix kernels take
   rows in tiles (oneDNN's AMX kernels 16 at a time), so 17 positions cost about what 32 do;
   on AVX-512 without AMX the cost grows smoothly (mtp/load_rule.py's measure_tile).
2. Attention groups. Whole passes of 16 rows over 150 cached tokens, for feeds such as
   14 rows of 1 token and 2 of 3: in one attention group, as mtp/engine.py's attention_groups
   keeps a short feed, and split in two, as it splits a prompt from one-token rows.

Cases take turns; each figure is the median of the timed repeats.

    python benchmarks/pass_shapes.py --model DIR --out DIR [--threads 2] [--repeats 30]

writes results.json and results.md to --out.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import mtp.engine as engine  # noqa: E402
from mtp.cli import Parser, cpu_name, positive_int, run_cli  # noqa: E402
from mtp.hf import from_pretrained, write_text  # noqa: E402

SIZES = [1, 8, 16, 17, 24, 32, 33, 48, 64, 65, 96, 128]
# feeds of 16 rows: (name, tokens each row feeds, split into two groups: the rows feeding most
# apart)
FEEDS = [("16 x 1", [1] * 16), ("15 x 1 + 1 x 2", [1] * 15 + [2]), ("16 x 2", [2] * 16),
         ("14 x 1 + 2 x 3", [1] * 14 + [3] * 2), ("16 x 3", [3] * 16)]


def timed(cases: dict, repeats: int) -> dict:
    """{name: median seconds} of each case's callable, the cases taking turns."""
    seconds = {name: [] for name in cases}
    for i in range(repeats + 3):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            if i >= 3:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def tiles(dtype, repeats) -> dict:
    weights = [torch.randn(1536, 576, dtype=dtype) for _ in range(60)]

    def product(x):
        return lambda: [torch.nn.functional.linear(x, w) for w in weights]

    cases = {m: product(torch.randn(m, 576, dtype=dtype)) for m in SIZES}
    return {m: s / len(weights) for m, s in timed(cases, repeats).items()}


def passes(model, repeats) -> dict:
    cache = engine.new_cache(model, 16, 300)
    one_group = engine.attention_groups

    def run(feeds, split):
        def groups(fed):
            if not split:
                return one_group(fed)
            most = max(fed)
            return [[b for b, n in enumerate(fed) if n < most],
                    [b for b, n in enumerate(fed) if n == most]]

        def one():
            engine.attention_groups = groups
            cache.rollback(0)
            cache.advance(150)
            with torch.inference_mode():
                engine.decode_pass(model, cache, [[5] * f for f in feeds],
                                   firsts=[f - 1 for f in feeds], n_preds=[1] * 16, pad_id=0)
        return one

    cases = {}
    for name, feeds in FEEDS:
        cases[name + ", one group"] = run(feeds, split=False)
        if len(set(feeds)) > 1:
            cases[name + ", two groups"] = run(feeds, split=True)
    try:
        return timed(cases, repeats)
    finally:
        engine.attention_groups = one_group


def markdown(r) -> str:
    lines = [f"### One pass's shape: {r['model']} on {r['cpu']} ({r['dtype']}, "
             f"{r['threads']} threads), medians of {r['repeats']}", "",
             "| positions M | " + " | ".join(str(m) for m in SIZES) + " |",
             "|---|" + "---|" * len(SIZES),
             "| 1536 x 576 product (us) | " + " | ".join(
                 f"{r['tiles'][str(m)] * 1e6:.0f}" for m in SIZES) + " |", "",
             "| 16 rows feeding | ms a pass |", "|---|---|"]
    lines += [f"| {name} | {s * 1e3:.1f} |" for name, s in r["passes"].items()]
    return "\n".join(lines) + "\n"


def parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (SmolLM2's)")
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=30)
    return p


def main_body(argv):
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    model = from_pretrained(args.model, dtype=dtype).eval()
    report = {"model": args.model, "cpu": cpu_name(), "dtype": "bfloat16",
              "threads": args.threads, "repeats": args.repeats,
              "tiles": {str(m): s for m, s in tiles(dtype, args.repeats).items()},
              "passes": passes(model, args.repeats)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "results.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "results.md", markdown(report))
    print(markdown(report))


def main(argv=None) -> int:
    return run_cli(main_body, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
