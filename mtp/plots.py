"""The figures of the toy experiment and of the packed layout, support code a learner can skip.

train_toy.py calls each toy figure once at the end of a run:

    pareto.png           accuracy and degeneration against tokens per forward pass
    training_curves.png  each phase's loss, step by step
    chunks.png           one answer of the distilled student, a colour per forward pass

scripts/show_layout.py shows one packed row of data.mtp_layout as a text table (layout_table)
and draws its attention mask (plot_attention_mask, the figure in the docs).

matplotlib is imported inside each function, so a run that draws nothing never loads it."""
import os

import torch

from confadapt import DecodeConfig
from data import MASK, PAD, MTPBatch
from mtp.chunks import chunk_texts, save_chunks_png
from mtp.engine import generate
from tasks.toy import BRANCHING_TASKS, TOY_TASKS, encode_example, heldout_examples

# How the figures draw each model (in this order) and each decoding
COLOUR = {"ntp": "black", "naive": "tab:red", "distill": "tab:blue"}
MARKER = {"ntp": dict(marker="*", ms=12), "naive": dict(marker="o", ms=4),
          "distill": dict(marker="s", ms=4)}
LINE = {"static": "-", "confadapt": "--", "lossless": "none"}
# what each model's training curve shows; the students add prefix_ntp_weight x the
# teacher's loss
TRAINING_TITLES = {"ntp": "teacher: next-token cross-entropy",
                   "naive": "naive: cross-entropy to the true next k (+ NTP)",
                   "distill": "distill: cross-entropy over the teacher's (+ NTP)"}


def plot_pareto(rows: list[dict], out: str):
    """OUT/pareto.png: accuracy and degeneration against tokens per forward pass, a column
    per task (no coherence: it equals accuracy here). The branching tasks alone, if there
    are any: on the others every curve sits at 0 or 1. Returns the figure."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")                  # files only, no window
    tasks = sorted({r["task"] for r in rows}, key=TOY_TASKS.index)
    title = "held-out prompts"
    branching = [t for t in tasks if t in BRANCHING_TASKS]
    if branching:
        tasks = branching
        title += " of the branching tasks"

    fig, axes = plt.subplots(2, len(tasks), figsize=(4 * len(tasks), 7.5), squeeze=False)
    for col, task in enumerate(tasks):
        for ax, metric in zip(axes[:, col], ("accuracy", "degeneration")):
            for name in COLOUR:
                for decode in LINE:
                    # in sweep order: static by k, ConfAdapt by falling tau
                    cells = sorted((r for r in rows if r["model"] == name and
                                    r["task"] == task and r["decode"] == decode),
                                   key=lambda r: -r["tau"] if r["tau"] else r["k"])
                    if cells:
                        draw_curve(ax, cells, metric, name, decode)
            ax.set(title=task, ylim=(-0.05, 1.05),
                   xlabel="effective k (tokens per forward pass)",
                   ylabel=metric)
            ax.grid(alpha=0.3)
        axes[1, col].set_ylabel("degeneration (one item repeated)")

    handles = axes[0][0].get_legend_handles_labels()
    fig.legend(*handles, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title + ": quality against tokens per forward pass "
                 "(labels: static k, ConfAdapt tau)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(os.path.join(out, "pareto.png"), dpi=110)
    plt.close(fig)
    return fig


def draw_curve(ax, cells: list[dict], metric: str, name: str, decode: str):
    """One model's sweep of one decoding kind; each point labelled with its k or tau."""
    marker = MARKER[name]
    if decode == "lossless":
        marker = dict(marker="D", mfc="none", ms=8)
    x = [r["effective_k"] for r in cells]
    y = [r[metric] for r in cells]
    ax.plot(x, y, ls=LINE[decode], color=COLOUR[name], label=f"{name} {decode}", **marker)
    if name == "ntp" or decode == "lossless":
        return
    style = dict(textcoords="offset points", color=COLOUR[name], fontsize=6)
    for r, point in zip(cells, zip(x, y)):
        if decode == "static":
            ax.annotate(f"k{r['k']}", point, xytext=(3, 4), **style)
        else:
            ax.annotate(f"τ{r['tau']:g}", point, xytext=(3, -9), **style)


def plot_training(logs: dict, out: str):
    """OUT/training_curves.png: each model's loss, step by step; `logs` maps the model's
    name (ntp, naive, distill) to its training log. Returns the figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, log) in zip(axes, logs.items()):
        ax.plot([s["step"] for s in log], [s["loss"] for s in log], lw=0.8,
                color=COLOUR[name])
        ax.set_title(TRAINING_TITLES[name], fontsize=10)
        ax.set(xlabel="step", ylabel="loss", yscale="log")
        ax.grid(alpha=0.3)
    # relative to the teacher, the distillation loss can be < 0
    axes[2].set_yscale("linear")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "training_curves.png"), dpi=110)
    plt.close(fig)
    return fig


def plot_chunks(model, tokenizer, cfg, out: str):
    """OUT/chunks.png: one held-out answer of the distilled student, a colour per pass
    (`cfg`: the run's k_max and max_new_tokens)."""
    example = heldout_examples("count", 1)[0]
    mode = DecodeConfig("confadapt", tau=0.9, k_max=cfg.k_max)
    prompt = encode_example(tokenizer, example)[0]
    gens, _ = generate(model, [prompt], cfg.max_new_tokens, mode=mode,
                       stop_ids=[tokenizer.eos_id])
    g = gens[0]
    title = (f"distilled student, {mode.describe()}: {len(g.tokens)} tokens in "
             f"{g.forward_passes} forward passes")
    save_chunks_png(os.path.join(out, "chunks.png"), example.prompt,
                    chunk_texts(tokenizer, g.tokens, g.chunk_sizes), g.chunk_sizes,
                    title=title)


# ------- the packed layout of one row (scripts/show_layout.py) -------

def token_labels(batch: MTPBatch, row: int, token_str) -> list[str]:
    """A label per packed token of one row: the token, or "M" for a mask slot, "P" for
    padding."""
    tokens, kinds = batch.input_ids[row].tolist(), batch.kind[row].tolist()
    return ["M" if c == MASK else "P" if c == PAD else token_str(t)
            for t, c in zip(tokens, kinds)]


def layout_table(batch: MTPBatch, row: int = 0, token_str=str) -> str:
    """One packed row as a text table: token, position, kind, the prediction read there,
    its target."""
    L = batch.input_ids.shape[1]
    pred, target = [""] * L, [""] * L
    regions = zip(batch.pred_index[row].tolist(), batch.targets[row].tolist(),
                  batch.valid[row].tolist())
    for r, (idx_r, tgt_r, ok_r) in enumerate(regions):
        for j, (i, t, ok) in enumerate(zip(idx_r, tgt_r, ok_r)):
            pred[i], target[i] = f"{r}.{j}", token_str(t) if ok else "-"
    cells = {"idx": [str(i) for i in range(L)],
             "token": token_labels(batch, row, token_str),
             "pos": [str(p) for p in batch.positions[row].tolist()],
             "kind": ["GMCP"[c] for c in batch.kind[row].tolist()],
             "pred": pred,
             "target": target}
    width = max(len(c) for col in cells.values() for c in col) + 1
    return "\n".join(f"{name:<7}" + "".join(c.rjust(width) for c in col)
                     for name, col in cells.items())


def plot_attention_mask(batch: MTPBatch, path, row: int = 0, token_str=str):
    """Save the (L, L) attention mask of one row as a PNG, cells coloured by the key's
    kind."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure          # no pyplot: no global backend state
    from matplotlib.patches import Patch
    # in kind order
    names = ("ground truth", "mask slot", "copy", "padding")
    colours = ["#3b75af", "#ef8636", "#519e3e", "#b0b0b0"]
    mask, kind = batch.attn_mask[row].cpu(), batch.kind[row].cpu()
    L = mask.shape[0]
    # a cell not attended stays blank
    image = torch.where(mask, kind[None, :].expand(L, L).float(), float("nan"))    # (L, L)
    fig = Figure(figsize=(2 + 0.28 * L, 1.5 + 0.28 * L))
    title = (f"MTP attention mask: k={batch.k}, offset={batch.offset}, "
             f"{len(batch.prefix_end)} regions")
    ax = fig.add_subplot(xlabel="key (token @ position)", ylabel="query", title=title)
    ax.imshow(image.numpy(), cmap=ListedColormap(colours), vmin=-0.5, vmax=3.5,
              interpolation="nearest")
    labels = [f"{label} @{p}" for label, p in zip(token_labels(batch, row, token_str),
                                                  batch.positions[row].tolist())]
    ax.set_xticks(range(L), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(L), labels, fontsize=7)
    for tick, c in zip(ax.get_xticklabels() + ax.get_yticklabels(), kind.tolist() * 2):
        tick.set_color(colours[c])
    legend = [Patch(color=c, label=n) for n, c in zip(names, colours)]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
