"""The toy experiment (train_toy.py): its run folder, its fair comparison of the students, and
the script end to end, run once in --quick mode (tiny model, few steps) into a temporary
folder. The toy tasks themselves are tested in test_toy.py.
"""
import json
import os
import re
from dataclasses import asdict, replace
from functools import partial

import pytest
import torch

import data
import train_toy
from model import Transformer, write_json
from tasks.toy import BRANCHING_TASKS, TOY_TASKS, toy_batch, toy_tokenizer

ROW_KEYS = {"model", "decode", "k", "tau", "task", "accuracy", "coherence", "degeneration",
            "effective_k", "tokens_per_s", "forward_passes"}


# --- the script ------------------------------------------------------------------------

def test_a_run_folder_resumes_its_phases_and_refuses_other_settings(tmp_path):
    """The folder keeps its settings (run_config.json, written as JSON: tuples become lists)
    and each finished phase; the same settings load them, other settings are refused with
    every setting that differs named, whatever it is: the model, a schedule, the tasks."""
    out = str(tmp_path)
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    model = train_toy.build_teacher(cfg, toy_tokenizer(), "cpu")
    write_json(tmp_path / "run_config.json", asdict(cfg))
    phase = train_toy.Phase(model, log=[{"loss": 1.0}], seconds=2.0)
    train_toy.save_phase(out, "teacher", phase)

    done = train_toy.check_run_folder(out, cfg)
    assert list(done) == ["teacher"]
    assert done["teacher"].log == [{"loss": 1.0}]
    loaded = done["teacher"].model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded[name])

    other = {"dim": 32, "warmup_steps": 2, "weight_decay": 0.2, "n_eval": 3,
             "tasks": ("count", "zoo")}
    for name, value in other.items():
        with pytest.raises(train_toy.CliError, match=f"{name} .* -> "):
            train_toy.check_run_folder(out, replace(cfg, **{name: value}))
    with pytest.raises(train_toy.CliError, match=r"dim 64 -> 32, ffn_dim 192 -> 384\)"):
        train_toy.check_run_folder(out, replace(cfg, dim=32, ffn_dim=384))
    # checkpoints without their settings: an older version's run, never loaded unchecked
    os.remove(tmp_path / "run_config.json")
    with pytest.raises(train_toy.CliError, match="no run_config.json"):
        train_toy.check_run_folder(out, cfg)


def test_both_students_train_on_the_same_batches_and_layouts(monkeypatch):
    """naive vs distill is a fair comparison: step by step the same sequences, k and
    offsets. Only the distilled student needs a frozen copy of the teacher."""
    cfg = train_toy.RunConfig(**{**train_toy.QUICK, "mtp_steps": 3})
    tok = toy_tokenizer()
    teacher = train_toy.build_teacher(cfg, tok, "cpu")
    layouts = []
    copies = []
    real = data.random_mtp_layout
    real_copy = train_toy.frozen_teacher

    def recorded(*args, **kwargs):
        layouts.append(real(*args, **kwargs))
        return layouts[-1]

    monkeypatch.setattr(data, "random_mtp_layout", recorded)
    monkeypatch.setattr(train_toy, "frozen_teacher",
                        lambda model: copies.append(model) or real_copy(model))
    batches = partial(toy_batch, tok, tasks=cfg.tasks, seq_len=cfg.seq_len)
    for name, mode in train_toy.STUDENT_MODE.items():
        student = train_toy.student_from(teacher, "cpu")
        train_toy.train_phase(name, student, cfg, batches, "cpu", mode=mode,
                              tokenizer=train_toy.student_tokenizer())
    assert len(copies) == 1

    steps = cfg.mtp_steps
    assert len(layouts) == 2 * steps
    for a, b in zip(layouts[:steps], layouts[steps:]):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.valid, b.valid)
    # k really is drawn per step
    assert len({layout.input_ids.shape for layout in layouts}) > 1


def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    hf = tmp_path / "hf"
    results = train_toy.main(["--quick", "--out", str(out)])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(results["rows"]))
    rows = on_disk["rows"]
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["model"] in train_toy.MODELS
        assert row["decode"] in ("static", "confadapt", "lossless")
        assert row["task"] in TOY_TASKS
        for metric in ("accuracy", "coherence", "degeneration"):
            assert 0.0 <= row[metric] <= 1.0
        assert 1.0 <= row["effective_k"] <= max(row["k"], 1)
        assert (row["tau"] is None) == (row["decode"] != "confadapt")
    decodes = {(r["model"], r["decode"]) for r in rows}
    students = {(m, d) for m in ("naive", "distill")
                for d in ("static", "confadapt", "lossless")}
    assert decodes == {("ntp", "static")} | students
    assert {"device", "seconds", "config"} <= set(on_disk)
    phases = {"teacher", "naive", "distill", "evaluation", "total"}
    assert phases <= set(on_disk["seconds"])

    # provenance: the commit (None outside git), the CPU, the compute dtype, torch, threads
    commit = on_disk["commit"]
    assert commit is None or re.fullmatch("[0-9a-f]{40}", commit)
    assert on_disk["cpu"]
    assert on_disk["dtype"] == "float32"
    assert on_disk["torch"] == torch.__version__
    assert on_disk["threads"] == torch.get_num_threads()
    for png in ("pareto.png", "training_curves.png", "chunks.png"):
        assert (out / png).stat().st_size > 1000, png
    # the PNG header's width: a column per branching task
    header = (out / "pareto.png").read_bytes()
    width = int.from_bytes(header[16:20], "big")
    assert width == 4 * len(BRANCHING_TASKS) * 110

    # the summary quotes the rows exactly
    assert set(on_disk["summary"]) == set(TOY_TASKS)
    distill = {(r["decode"], r["tau"], r["task"]): r["accuracy"]
               for r in rows if r["model"] == "distill"}
    quoted = on_disk["summary"]["count"]["distill tau=0.9: accuracy"]
    assert quoted == distill["confadapt", 0.9, "count"]

    # --export-hf only exports the finished run: the teacher and both students, named.
    def mtimes():
        return {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    before = mtimes()
    argv = ["--quick", "--out", str(out), "--export-hf", str(hf)]
    exported = train_toy.main(argv)
    assert exported["models"] == ["ntp", "naive", "distill"]
    assert mtimes() == before
    teacher = Transformer.from_pretrained(hf / "teacher")
    assert teacher.config.mask_token_id is None
    assert (hf / "teacher" / "tokenizer.json").exists()
    for name in ("naive", "distill"):
        student = Transformer.from_pretrained(hf / name)
        assert student.config.mask_token_id == teacher.config.vocab_size
        assert (hf / name / "tokenizer.json").exists()
    tokens = torch.tensor([[1, 2, 3]])
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    checkpoint = train_toy.check_run_folder(str(out), cfg)["teacher"]
    assert torch.allclose(teacher(tokens), checkpoint.model(tokens), atol=1e-5)
