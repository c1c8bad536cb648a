"""Show the packed MTP training layout (data.mtp_layout) of one toy row: a table and a figure.

    python scripts/show_layout.py                         # the table, and the figure in the docs
    python scripts/show_layout.py --k 3 --offset 2 --regions 3 --png /tmp/mask.png

The table lists each packed token with its position, its kind (G ground truth, M mask slot,
C copy, P padding), the prediction `r.j` read there (region r, prediction j) and its target.
The figure is the row's attention mask: a cell is coloured where the query (row) may attend to
the key (column), in the key's kind's colour. mtp/plots.py makes both.
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import mtp_layout  # noqa: E402
from mtp.cli import Parser, count, positive_int, run_cli  # noqa: E402
from mtp.plots import layout_table, plot_attention_mask  # noqa: E402
from tasks.toy import TOY_SEQ_LEN, TOY_TASKS, toy_batch, toy_tokenizer  # noqa: E402


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
