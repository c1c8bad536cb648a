"""train_toy.py's run folder and closing table (mtp/toy_run.py): a folder resumes the phases it
finished, refuses a run of other settings, and the summary prints as a table.
"""
import os
from dataclasses import asdict, replace

import pytest
import torch

import train_toy
from mtp.hf import write_json
from mtp.cli import CliError
from mtp.toy_run import Phase, check_run_folder, format_summary, save_phase
from tasks.toy import toy_tokenizer


def test_a_run_folder_resumes_its_phases_and_refuses_other_settings(tmp_path):
    """The folder keeps its settings (run_config.json, written as JSON: tuples become lists)
    and each finished phase; the same settings load them, other settings are refused with
    every setting that differs named, whatever it is: the model, a schedule, the tasks."""
    out = str(tmp_path)
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    model = train_toy.build_teacher(cfg, toy_tokenizer(), "cpu")
    write_json(tmp_path / "run_config.json", asdict(cfg))
    phase = Phase(model, log=[{"loss": 1.0}], seconds=2.0)
    save_phase(out, "teacher", phase)

    done = check_run_folder(out, cfg, train_toy.PHASES)
    assert list(done) == ["teacher"]
    assert done["teacher"].log == [{"loss": 1.0}]
    loaded = done["teacher"].model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded[name])

    other = {"dim": 32, "warmup_steps": 2, "weight_decay": 0.2, "n_eval": 3,
             "tasks": ("count", "zoo")}
    for name, value in other.items():
        with pytest.raises(CliError, match=f"{name} .* -> "):
            check_run_folder(out, replace(cfg, **{name: value}), train_toy.PHASES)
    with pytest.raises(CliError, match=r"dim 64 -> 32, ffn_dim 192 -> 384\)"):
        check_run_folder(out, replace(cfg, dim=32, ffn_dim=384), train_toy.PHASES)
    # checkpoints without their settings are never loaded unchecked
    os.remove(tmp_path / "run_config.json")
    with pytest.raises(CliError, match="no run_config.json"):
        check_run_folder(out, cfg, train_toy.PHASES)


def test_the_table_shows_percentages_tokens_per_pass_and_gaps():
    """Percentages rounded, tokens per pass in brackets, a branching task marked, a missing
    cell as "-", names left-aligned and figures right-aligned."""
    columns = (("teacher k=1", dict(model="ntp"), ("accuracy",)),
               ("distill tau=0.9", dict(model="distill"), ("accuracy", "effective_k")))
    table = {"count": {"teacher k=1: accuracy": 1.0,
                       "distill tau=0.9: accuracy": 0.996,
                       "distill tau=0.9: effective_k": 3.6543},
             "zoo": {"teacher k=1: accuracy": 0.5}}
    lines = format_summary(table, columns).splitlines()
    assert lines[:4] == ["                 teacher k=1  distill tau=0.9",
                         "task                    acc.  acc. (tok/pass)",
                         "count                   100%      100% (3.65)",
                         "zoo (branching)          50%                -"]
    assert lines[4].startswith("held-out prompts; acc. = accuracy")
    assert len(lines) == 5
