"""train_toy.py's run folder and closing table, support code a learner can skip.

A run folder OUT keeps its settings in run_config.json and each finished phase in
OUT/checkpoints/<phase>.pt, so that running the same command again resumes where it stopped
and a run of other settings is refused rather than mixed in. --export-hf writes a finished
run's models in Hugging Face layout. format_summary turns the summary of results.json into
the table the run prints."""
import json
import os
from dataclasses import asdict
from typing import NamedTuple

import torch

from model import ModelConfig, Transformer
from mtp.hf import atomic_save, read_json, save_pretrained
from mtp.cli import CliError, format_seconds, output_folder, read_checkpoint
from tasks.toy import BRANCHING_TASKS


class Phase(NamedTuple):
    """A finished phase, trained now or loaded from its checkpoint."""
    model: Transformer
    log: list
    seconds: float


def checkpoint_path(out: str, phase: str) -> str:
    return os.path.join(out, "checkpoints", f"{phase}.pt")


def check_run_folder(out: str, cfg, phases) -> dict:
    """Before any work: the phases (of `phases`) finished in `out`, {phase: Phase}. A folder
    that holds a run of other settings than `cfg` (a dataclass; its run_config.json) is an
    error, naming what differs."""
    path = os.path.join(out, "run_config.json")
    if os.path.exists(path):
        saved = read_json(path, "run config")
        # the settings as JSON keeps them: tuples as lists
        now = json.loads(json.dumps(asdict(cfg)))
        changes = [f"{k} {saved.get(k)} -> {now.get(k)}"
                   for k in sorted({*saved, *now}) if saved.get(k) != now.get(k)]
        if changes:
            raise CliError(f"{out} holds a run with other settings ({', '.join(changes)}): "
                           f"choose another --out, or add --restart to train again")
    elif any(os.path.exists(checkpoint_path(out, phase)) for phase in phases):
        # without their settings the checkpoints cannot be checked, so they are never loaded
        raise CliError(f"{out} holds checkpoints but no run_config.json, so their settings "
                       f"are unknown: choose another --out, or add --restart to train again")
    done = {}
    for phase in phases:
        path = checkpoint_path(out, phase)
        if not os.path.exists(path):
            continue
        try:
            ckpt = read_checkpoint(path, "toy checkpoint")
        except ValueError as e:
            raise CliError(f"{e}; --restart trains every phase again") from None
        model = Transformer(ModelConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["state"])
        done[phase] = Phase(model.eval(), ckpt["log"], ckpt["seconds"])
    return done


def save_phase(out: str, name: str, phase: Phase):
    path = checkpoint_path(out, name)
    model = phase.model
    ckpt = dict(model_config=asdict(model.config), state=model.state_dict(),
                log=phase.log, seconds=phase.seconds)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a crash leaves the old file or the new, never half of one
    atomic_save(lambda tmp: torch.save(ckpt, tmp), path)
    print(f"== {name}: trained in {format_seconds(phase.seconds)} "
          f"(final loss {phase.log[-1]['loss']:.4f}), saved {path}")


def export_hf(path: str, out: str, done: dict, tokenizers: dict):
    """--export-hf: the models `done` of the run in `out` as DIR/<phase> in Hugging Face
    layout, each with its tokenizer ({phase: tokenizer}, which names every phase)."""
    missing = [p for p in tokenizers if p not in done]
    if missing:
        raise CliError(f"--export-hf: {out} has no finished {', '.join(missing)} for these "
                       f"settings; run the same command without --export-hf first")
    output_folder(path, "--export-hf")
    for phase, tokenizer in tokenizers.items():
        save_pretrained(done[phase].model, os.path.join(path, phase))
        tokenizer.save_pretrained(os.path.join(path, phase))
    *first, last = [f"{path}/{phase}" for phase in tokenizers]
    print(f"exported {', '.join(first)} and {last} (Hugging Face layout)")


# The table's cells: the header and the format of each set of metrics
CELL = {("accuracy",): ("acc.", "{:.0%}"),
        ("accuracy", "effective_k"): ("acc. (tok/pass)", "{:.0%} ({:.2f})"),
        ("coherence", "degeneration"): ("coh. / degen.", "{:.0%} / {:.0%}")}


def format_summary(table: dict, columns) -> str:
    """The table for people: percentages, and tokens per forward pass in brackets.
    `columns`: (column, the results row it reads, its metrics) each, as train_toy.SUMMARY."""
    lines = [["", *(column for column, _, _ in columns)],
             ["task", *(CELL[metrics][0] for _, _, metrics in columns)]]
    for task, values in table.items():
        cells = [task + " (branching)" if task in BRANCHING_TASKS else task]
        for column, _, metrics in columns:
            if f"{column}: {metrics[0]}" in values:
                figures = [values[f"{column}: {m}"] for m in metrics]
                cells.append(CELL[metrics][1].format(*figures))
            else:
                cells.append("-")
        lines.append(cells)

    # the task names left-aligned, the figures right-aligned
    widths = [max(map(len, column)) for column in zip(*lines)]
    body = []
    for cells in lines:
        figures = [x.rjust(w) for x, w in zip(cells[1:], widths[1:])]
        body.append("  ".join([cells[0].ljust(widths[0]), *figures]))
    legend = ("held-out prompts; acc. = accuracy, coh. = coherent, degen. = degenerate "
              "(one item repeated); k=4: static k, tau=0.9: ConfAdapt; "
              "tok/pass: tokens per forward pass")
    return "\n".join(body + [legend])
