"""The toy experiment (train_toy.py): a fair comparison of the students, and the script end to
end. The script runs once in --quick mode (tiny model, few steps) into a temporary folder, and
each test below checks one claim about that run. The toy tasks are tested in test_toy.py, the
run folder in test_toy_run.py.
"""
import contextlib
import io
import json
import re
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from matplotlib.image import imread

import data
import train_toy
from mtp.chunks import PNG_COLOURS
from mtp.hf import from_pretrained
from mtp.plots import plot_pareto, plot_training
from mtp.toy_run import check_run_folder, format_summary
from tasks.toy import BRANCHING_TASKS, TOY_TASKS, toy_batch, toy_tokenizer

ROW_KEYS = {"model", "decode", "k", "tau", "task", "accuracy", "coherence", "degeneration",
            "effective_k", "tokens_per_s", "forward_passes"}


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


# --- one --quick run, shared by the tests below ----------------------------------------

@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A finished --quick run: its folder, what main returned, results.json, what it printed
    and the torch threads it ran with."""
    out = tmp_path_factory.mktemp("toy") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = train_toy.main(["--quick", "--out", str(out)])
    on_disk = json.loads((out / "results.json").read_text())
    return SimpleNamespace(out=out, results=results, on_disk=on_disk,
                           printed=printed.getvalue(), threads=torch.get_num_threads())


def test_results_json_holds_the_rows_main_returns(quick):
    assert quick.on_disk["rows"] == json.loads(json.dumps(quick.results["rows"]))


def test_every_row_is_one_measurement_in_range(quick):
    for row in quick.on_disk["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["model"] in train_toy.MODELS
        assert row["decode"] in ("static", "confadapt", "lossless")
        assert row["task"] in TOY_TASKS
        for metric in ("accuracy", "coherence", "degeneration"):
            assert 0.0 <= row[metric] <= 1.0
        assert 1.0 <= row["effective_k"] <= max(row["k"], 1)
        assert (row["tau"] is None) == (row["decode"] != "confadapt")


def test_the_teacher_decodes_greedily_and_the_students_every_way(quick):
    decodes = {(r["model"], r["decode"]) for r in quick.on_disk["rows"]}
    students = {(m, d) for m in ("naive", "distill")
                for d in ("static", "confadapt", "lossless")}
    assert decodes == {("ntp", "static")} | students


def test_results_name_the_device_and_time_every_phase(quick):
    on_disk = quick.on_disk
    assert {"device", "seconds", "config"} <= set(on_disk)
    phases = {"teacher", "naive", "distill", "evaluation", "total"}
    assert phases <= set(on_disk["seconds"])


def test_results_record_their_provenance(quick):
    """The commit (None outside git), the CPU, the compute dtype, torch, threads."""
    on_disk = quick.on_disk
    commit = on_disk["commit"]
    assert commit is None or re.fullmatch("[0-9a-f]{40}", commit)
    assert on_disk["cpu"]
    assert on_disk["dtype"] == "float32"
    assert on_disk["torch"] == torch.__version__
    assert on_disk["threads"] == quick.threads


def test_the_summary_quotes_the_rows_exactly(quick):
    on_disk = quick.on_disk
    assert set(on_disk["summary"]) == set(TOY_TASKS)
    distill = {(r["decode"], r["tau"], r["task"]): r["accuracy"]
               for r in on_disk["rows"] if r["model"] == "distill"}
    quoted = on_disk["summary"]["count"]["distill tau=0.9: accuracy"]
    assert quoted == distill["confadapt", 0.9, "count"]


def test_the_run_prints_the_table_of_its_summary(quick):
    table = format_summary(quick.on_disk["summary"], train_toy.SUMMARY)
    assert table in quick.printed
    # a row per task under the two header lines, then the legend
    assert len(table.splitlines()) == 2 + len(TOY_TASKS) + 1


def test_pareto_png_has_a_column_per_branching_task(quick):
    # 4 x 7.5 inches per column at 110 dpi
    height, width, _ = imread(quick.out / "pareto.png").shape
    assert width == 4 * len(BRANCHING_TASKS) * 110
    assert height == 7.5 * 110


def test_pareto_draws_every_model_and_decoding_in_each_panel(quick, tmp_path):
    """Accuracy and degeneration for each branching task; the teacher's one greedy point and
    each student's static, ConfAdapt and lossless curves in every panel."""
    fig = plot_pareto(quick.on_disk["rows"], str(tmp_path))
    assert len(fig.axes) == 2 * len(BRANCHING_TASKS)
    curves = ["ntp static"] + [f"{m} {d}" for m in ("naive", "distill")
                               for d in ("static", "confadapt", "lossless")]
    for ax in fig.axes:
        assert [line.get_label() for line in ax.lines] == curves


def test_training_curves_show_every_step_of_each_phase(quick, tmp_path):
    height, width, _ = imread(quick.out / "training_curves.png").shape
    assert (width, height) == (14 * 110, 4 * 110)
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    done = check_run_folder(str(quick.out), cfg, train_toy.PHASES)
    logs = {label: done[phase].log for label, phase in zip(train_toy.MODELS, train_toy.PHASES)}
    fig = plot_training(logs, str(tmp_path))
    steps = [len(ax.lines[0].get_xdata()) for ax in fig.axes]
    assert steps == [cfg.teacher_steps, cfg.mtp_steps, cfg.mtp_steps]
    # the distillation loss, relative to the teacher's, can be < 0: a linear axis
    assert [ax.get_yscale() for ax in fig.axes] == ["log", "log", "linear"]


def test_chunks_png_colours_each_forward_pass(quick):
    """One background colour per pass, alternating: the second colour appears only when the
    distilled student's answer took two passes or more (its sample in results.json; the
    decoder gives a prompt the same tokens alone as in a batch)."""
    pixels = imread(quick.out / "chunks.png")[..., :3]                 # (H, W, RGB) in [0, 1]

    def shows(colour):
        rgb = torch.tensor([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        return bool((torch.from_numpy(pixels) - rgb).abs().amax(-1).lt(1 / 255).any())

    sample = quick.on_disk["samples"]["distill"]["count | confadapt tau=0.9 k_max=8"]
    passes = sample.count(" |")
    assert passes >= 1
    assert shows(PNG_COLOURS[0])
    assert shows(PNG_COLOURS[1]) == (passes >= 2)


# --- --export-hf ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(quick, tmp_path_factory):
    """The quick run exported with --export-hf: what main returned, the export folder, and
    the run folder's files' modification times before and after."""
    hf = tmp_path_factory.mktemp("export") / "hf"

    def mtimes():
        return {p: p.stat().st_mtime_ns for p in quick.out.rglob("*")}

    before = mtimes()
    argv = ["--quick", "--out", str(quick.out), "--export-hf", str(hf)]
    with contextlib.redirect_stdout(io.StringIO()):
        returned = train_toy.main(argv)
    return SimpleNamespace(returned=returned, hf=hf, before=before, after=mtimes())


def test_export_hf_only_exports_the_finished_run(exported):
    """The teacher and both students, named; the run folder is left as it was."""
    assert exported.returned["models"] == ["ntp", "naive", "distill"]
    assert exported.after == exported.before


def test_exported_students_have_a_mask_token_and_the_teacher_none(exported):
    hf = exported.hf
    teacher = from_pretrained(hf / "teacher")
    assert teacher.config.mask_token_id is None
    assert (hf / "teacher" / "tokenizer.json").exists()
    for name in ("naive", "distill"):
        student = from_pretrained(hf / name)
        assert student.config.mask_token_id == teacher.config.vocab_size
        assert (hf / name / "tokenizer.json").exists()


def test_the_exported_teacher_computes_what_its_checkpoint_does(quick, exported):
    teacher = from_pretrained(exported.hf / "teacher")
    tokens = torch.tensor([[1, 2, 3]])
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    checkpoint = check_run_folder(str(quick.out), cfg, train_toy.PHASES)["teacher"]
    assert torch.allclose(teacher(tokens), checkpoint.model(tokens), atol=1e-5)
