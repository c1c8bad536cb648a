"""Show the packed MTP training layout (data.mtp_layout) of one toy row: a table and a figure.

    python scripts/show_layout.py                         # the table, and the figure in the docs
    python scripts/show_layout.py --k 3 --offset 2 --regions 3 --png /tmp/mask.png

The table lists each packed token with its position, its kind (G ground truth, M mask slot,
C copy, P padding), the prediction `r.j` read there (region r, prediction j) and its target.
The figure is the row's attention mask: a cell is coloured where the query (row) may attend to
the key (column), in the key's kind's colour.
"""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import MASK, PAD, MTPBatch, mtp_layout  # noqa: E402
from mtp.cli import Parser, count, positive_int, run_cli  # noqa: E402
from tasks.toy import TOY_SEQ_LEN, TOY_TASKS, toy_batch, toy_tokenizer  # noqa: E402


def token_labels(batch: MTPBatch, row: int, token_str) -> list[str]:
    """A label per packed token of one row: the token, or "M" for a mask slot, "P" for padding."""
    return ["M" if c == MASK else "P" if c == PAD else token_str(t)
            for t, c in zip(batch.input_ids[row].tolist(), batch.kind[row].tolist())]


def layout_table(batch: MTPBatch, row: int = 0, token_str=str) -> str:
    """One packed row as a text table: token, position, kind, the prediction read there, its target."""
    L = batch.input_ids.shape[1]
    pred, target = [""] * L, [""] * L
    regions = zip(batch.pred_index[row].tolist(), batch.targets[row].tolist(), batch.valid[row].tolist())
    for r, (idx_r, tgt_r, ok_r) in enumerate(regions):
        for j, (i, t, ok) in enumerate(zip(idx_r, tgt_r, ok_r)):
            pred[i], target[i] = f"{r}.{j}", token_str(t) if ok else "-"
    cells = {"idx": [str(i) for i in range(L)], "token": token_labels(batch, row, token_str),
             "pos": [str(p) for p in batch.positions[row].tolist()],
             "kind": ["GMCP"[c] for c in batch.kind[row].tolist()], "pred": pred, "target": target}
    width = max(len(c) for col in cells.values() for c in col) + 1
    return "\n".join(f"{name:<7}" + "".join(c.rjust(width) for c in col) for name, col in cells.items())


def plot_attention_mask(batch: MTPBatch, path, row: int = 0, token_str=str):
    """Save the (L, L) attention mask of one row as a PNG, cells coloured by the key's kind."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure          # no pyplot: no global backend state
    from matplotlib.patches import Patch
    names = ("ground truth", "mask slot", "copy", "padding")                      # in kind order
    colours = ["#3b75af", "#ef8636", "#519e3e", "#b0b0b0"]
    mask, kind = batch.attn_mask[row].cpu(), batch.kind[row].cpu()
    L = mask.shape[0]
    image = torch.where(mask, kind[None, :].expand(L, L).float(), float("nan"))   # not attended: blank
    fig = Figure(figsize=(2 + 0.28 * L, 1.5 + 0.28 * L))
    ax = fig.add_subplot(xlabel="key (token @ position)", ylabel="query", title="MTP attention mask:"
                         f" k={batch.k}, offset={batch.offset}, {len(batch.prefix_end)} regions")
    ax.imshow(image.numpy(), cmap=ListedColormap(colours), vmin=-0.5, vmax=3.5, interpolation="nearest")
    labels = [f"{label} @{p}" for label, p in zip(token_labels(batch, row, token_str),
                                                  batch.positions[row].tolist())]
    ax.set_xticks(range(L), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(L), labels, fontsize=7)
    for tick, c in zip(ax.get_xticklabels() + ax.get_yticklabels(), kind.tolist() * 2):
        tick.set_color(colours[c])
    ax.legend(handles=[Patch(color=c, label=n) for n, c in zip(names, colours)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def show(argv):
    p = Parser(prog="show_layout.py", description=__doc__.split("\n")[0])
    p.add_argument("--task", default="count", choices=TOY_TASKS, help="the toy task of the row")
    p.add_argument("--seed", type=count, default=0, help="which row of the task")
    p.add_argument("--k", type=positive_int, default=4, help="predictions per region (k-1 mask slots)")
    p.add_argument("--offset", type=count, default=5, help="where the first region's prefix ends")
    p.add_argument("--regions", type=positive_int, default=2, help="MTP problems in the row")
    p.add_argument("--png", default="docs/figures/toy_attention_mask.png", help="the figure to write")
    args = p.parse_args(argv)
    tokenizer = toy_tokenizer()
    tokenizer.add_special_token("<mask>")                 # the id a toy student's <mask> gets
    seqs, _ = toy_batch(tokenizer, random.Random(args.seed), 1, tasks=(args.task,),
                        seq_len=TOY_SEQ_LEN)
    batch = mtp_layout(seqs, args.k, args.offset, args.regions, mask_id=tokenizer.mask_id,
                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    token_str = lambda t: tokenizer.decode([t]).strip()   # noqa: E731
    print(layout_table(batch, token_str=token_str))
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    plot_attention_mask(batch, args.png, token_str=token_str)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    sys.exit(run_cli(show, sys.argv[1:]))
