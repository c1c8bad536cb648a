"""Benchmark, computed and not measured: the memory one training process of finetune_hf.py
holds at full scale, for a full fine-tune and for the gated mask adapter, on Llama-3.1-8B and
SmolLM2-135M.

Each model is built on the meta device (shapes, no memory) as `finetune_hf.load_student_and_teacher`
builds it on one process, with <mask> added as one more row of the embedding and output matrices
(what model.add_mask_token does when the tokenizer, as both of these, fills the matrix):

    full      float32 master weights, a frozen bfloat16 teacher copy, float32 gradients and AdamW
    adapter   the frozen base in bfloat16, a rank-32 update on all 7 projections and the <mask>
              embedding in float32 (gradients and AdamW for those alone); the teacher is the
              student with its adapter off, no copy

Training state: mtp.distributed.training_state_bytes of that model. Activations: one micro-batch's
forward and loss (data.mtp_layout, then distill.mtp_loss, or for the adapter
adapter.gated_mtp_loss, whose gradient pass runs over the mask slots alone) run on the meta
device, adding up every tensor saved for backward: what the step holds when its backward
starts. The paper's step by default (8 rows of 160 tokens, k = k_max = 16, the longest layout a
step draws, 5 regions).

    python benchmarks/memory.py [--k 4 --regions 80] [--out results/memory] [--overwrite]

writes memory.json and memory.md to --out. mtp/memory.py computes the figures and says how the
activations are counted (under autocast to bfloat16, each storage once, on the meta device);
tests/test_memory.py checks the count against real CPU tensors of a tiny model.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp.cli import CliError, Parser, number, output_folder, positive_int, run_cli  # noqa: E402
from data import default_n_regions  # noqa: E402
from model import ModelConfig  # noqa: E402
from mtp.hf import atomic_save, write_json  # noqa: E402
from mtp.memory import MODES, Step, figures, with_mask  # noqa: E402

# The two models, as in their config.json: only what changes a byte.
MODELS = {
    "llama-3.1-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                ffn_dim=14336, rope_theta=500000.0),
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True),
}
WRITES = ("memory.json", "memory.md")
MARK = "benchmarks/memory.py"       # in both files: written by this script
COMPUTED = ("Computed, not measured on a GPU: the training state from the parameter counts of the "
            "models built on the meta device, the activations from the tensors one micro-batch's "
            "forward and loss save for backward there (under autocast to bfloat16, as finetune_hf "
            "computes on one GPU). Not included: tensors that live only inside the forward or the "
            "backward, the CUDA context, the allocator's fragmentation.")

COLUMNS = {"weights": "weights", "teacher": "teacher", "gradients": "gradients", "AdamW": "AdamW",
           "training_state": "training state", "activations": "activations (one micro-batch)",
           "sum": "sum"}


def markdown(report: dict) -> str:
    step = report["step"]
    lines = [f"# Memory of one training process ({MARK})", "",
             f"One micro-batch: {step['micro_batch']} rows of {step['seq_len']} tokens, "
             f"k = {step['k']}, {step['regions']} regions, so packed rows of "
             f"{step['packed_len']} tokens. GiB = 2^30 bytes.", "",
             "| model | mode | " + " | ".join(COLUMNS.values()) + " | fits on one 80 GB GPU "
             "| frozen base under torchrun (--shard-base auto, 80 GB GPUs) |",
             "|---|---|" + "---:|" * len(COLUMNS) + "---|---|"]
    for r in report["rows"]:
        cells = [r["model"], r["mode"], *(f"{r[c] / 2**30:.2f}" for c in COLUMNS)]
        base = "whole on each" if r["base_whole_on_80gb"] else "sharded"
        if r["mode"] == "full":
            base = "sharded (all of it trains)"
        lines.append("| " + " | ".join(cells) + f" | {'yes' if r['fits_80gb'] else 'no'} "
                     f"| {base} |")
    lines.append("")
    for name, ratio in report["adapter_over_full"].items():
        adapter = next(r for r in report["rows"] if r["model"] == name and r["mode"] == "adapter")
        lines.append(f"- {name}: the adapter trains {adapter['trained'] / 1e6:,.1f}M of "
                     f"{adapter['parameters'] / 1e6:,.1f}M parameters; its training state is "
                     f"{ratio:.3f} of the full fine-tune's.")
    lines += ["", "Under torchrun the adapter's row is also what each process holds when its "
              "frozen base is whole on every process (only the adapter's gradients are "
              "averaged); --shard-base auto chooses that where the sum is under 80% of the "
              "GPU's memory.", "", report["computed"]]
    return "\n".join(lines) + "\n"


def check_out(out: Path, overwrite: bool):
    """Refuse to replace a file this script did not write; replace its own with --overwrite."""
    output_folder(str(out), "--out")
    for name in WRITES:
        path = out / name
        if not path.exists():
            continue
        if MARK not in path.read_text(encoding="utf-8", errors="replace"):
            raise CliError(f"--out {out}: {name} was not written by {MARK}; "
                           "write into another folder")
        if not overwrite:
            raise CliError(f"--out {out} holds an earlier output of {MARK}: "
                           "add --overwrite to replace it")


def memory_main(argv):
    p = Parser(prog="memory.py", description="The memory one finetune_hf.py training process holds "
               "at full scale, full fine-tune and gated mask adapter: weights, teacher, gradients, "
               "AdamW and one micro-batch's activations, computed on the meta device from parameter "
               "counts and the tensors a step saves for backward (not measured), printed and "
               "written to --out as memory.json and memory.md.")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="models to compute")
    s = p.add_argument_group("the micro-batch (default: the paper's)")
    s.add_argument("--seq-len", type=number(int, 2), default=160, help="tokens per sequence")
    s.add_argument("--micro-batch", type=positive_int, default=8, help="sequences per forward pass")
    s.add_argument("--k", type=number(int, 2), default=16,
                   help="predictions per region; k = k_max gives a run's longest layout "
                   "(the SmolLM2 runs of results/smollm2/README.md: --k 4 --regions 80)")
    s.add_argument("--regions", type=positive_int,
                   help="MTP problems per sequence (default seq_len / (2 k))")
    p.add_argument("--adapter-rank", type=positive_int, default=32,
                   help="rank of the gated adapter's updates")
    p.add_argument("--out", default="results/memory", help="folder for memory.json and memory.md")
    p.add_argument("--overwrite", action="store_true",
                   help="replace this script's earlier output in --out")
    args = p.parse_args(argv)
    regions = args.regions or default_n_regions(args.seq_len, args.k)
    if regions > args.seq_len:
        raise CliError(f"--regions {regions}: at most --seq-len ({args.seq_len}) regions fit in a sequence")
    step = Step(args.seq_len, args.micro_batch, args.k, regions)
    out = Path(args.out)
    check_out(out, args.overwrite)
    models, rows = list(dict.fromkeys(args.models)), []
    for name in models:
        for mode in MODES:
            row = figures(with_mask(MODELS[name]), mode, step, args.adapter_rank)
            rows.append({"model": name, "mode": mode, **row})
    ratios = {}
    for name in models:
        full, adapter = (r["training_state"] for r in rows if r["model"] == name)
        ratios[name] = adapter / full
    packed_len = step.seq_len + step.regions * (step.k - 1)
    report = {"written_by": MARK, "step": {**vars(step), "packed_len": packed_len},
              "adapter_rank": args.adapter_rank, "rows": rows, "adapter_over_full": ratios,
              "computed": COMPUTED}
    text = markdown(report)
    print(text, end="")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "memory.json", report)
    atomic_save(lambda path: Path(path).write_text(text, encoding="utf-8"), out / "memory.md")


def main(argv=None) -> int:
    return run_cli(memory_main, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
