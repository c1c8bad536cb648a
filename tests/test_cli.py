"""What the three command lines do with what a user gives them.

Every bad value of every flag, and every broken file or folder, ends in one line `error: ...` on
stderr and a non-zero exit status, with no traceback, and leaves every existing run folder as it
was (each file's bytes and modification time). Ctrl-C ends in one line saying how to go on. And a
run never lands in another run's folder: a second run, a --quick run and a run with another seed
leave a finished run's checkpoints and results alone.

The commands are called in-process (main(argv) through mtp.cli.run_cli, what `python X.py`
runs), on a tiny model written here and two tiny finished runs, so the whole file takes seconds.
"""
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

import confadapt
import data
import finetune_hf
import train_toy
from mtp.cli import parse_device, parse_dtype, provenance, run_cli
from model import ModelConfig, Transformer
from mtp.hf import save_pretrained

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_modes  # noqa: E402  (benchmarks/bench_modes.py)
# scripts/word_problem_base.py, run as a file: no test imports a script by name
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
WORD_PROBLEM_BASE = runpy.run_path(str(SCRIPTS / "word_problem_base.py"))

pytestmark = pytest.mark.usefixtures("one_thread")                     # conftest.py

# The toy run of the tests: the full-size model for a few steps, one prompt per task.
TOY = ["--teacher-steps", "2", "--mtp-steps", "1", "--n-eval", "1"]
TRAIN = ["--seq-len", "32", "--batch-size", "2", "--micro-batch", "2", "--k-max", "4", "--warmup", "1",
         "--save-every", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny model with <mask> (Hugging Face layout), word-problem data, a finished finetune_hf
    run in ft/ and a finished toy run in runs/toy-teacher2-mtp1-eval1 (its default folder)."""
    root = tmp_path_factory.mktemp("cli")
    tok = data.word_problem_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.n_vocab, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    max_seq_len=64, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id))
    save_pretrained(model, root / "base")
    tok.save_pretrained(root / "base")
    (root / "base" / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_id}) + "\n")
    data.write_word_problems(root / "wp", n_train=8, n_test=2, seed=0)
    (root / "a_file").write_text("not a folder\n")
    cwd = os.getcwd()
    os.chdir(root)                                      # the toy's default folders are relative: runs/...
    try:
        assert finetune_hf.main(["train", "--model", "base", "--data", "wp/train.json", "--out", "ft", "--steps", "2",
                                 *TRAIN]) == 0
        train_toy.main(TOY)
    finally:
        os.chdir(cwd)
    assert (root / "runs" / "toy-teacher2-mtp1-eval1" / "results.json").is_file()
    return root


@pytest.fixture
def at_root(root, monkeypatch):
    monkeypatch.chdir(root)
    return root


def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def broken_models(root) -> dict:
    """Model folders broken in each way a user can break one (made once, beside the good one)."""
    made = root / "broken"
    if not made.exists():
        base = root / "base"
        config = json.loads((base / "config.json").read_text())
        cases = {"no_config": None, "bad_json": "{not json", "a_list": "[1, 2]",
                 "mistral": json.dumps({**config, "model_type": "mistral"}),
                 "no_heads": json.dumps({k: v for k, v in config.items() if k != "num_attention_heads"}),
                 "bad_tokenizer": json.dumps(config)}
        for name, text in cases.items():
            folder = made / name
            shutil.copytree(base, folder)
            if text is None:
                (folder / "config.json").unlink()
            else:
                (folder / "config.json").write_text(text)
        (made / "bad_tokenizer" / "tokenizer.json").write_bytes(b'{"model": {"vocab": ')
    return {p.name: str(p) for p in made.iterdir()}


def targetless_data_files(root) -> dict:
    """Well-formed rows that give nothing to train on: empty responses (with --response-only),
    answers that `data` marked unfinished."""
    made = root / "targetless"
    made.mkdir(exist_ok=True)
    rows = {"empty_responses": {"prompt": "Tom has 3 pens.", "response": ""},
            "unfinished": {"prompt": "Tom has 3 pens.", "response": "He", "finished": False}}
    for name, row in rows.items():
        (made / name).write_text((json.dumps(row) + "\n") * 3)
    return {name: str(made / name) for name in rows}


def bad_data_files(root) -> dict:
    made = root / "bad_data"
    made.mkdir(exist_ok=True)
    files = {"wrong_rows": '{"instruction": "x", "output": "y"}\n', "bad_json": '[{"query": "x",',
             "empty": "", "not_objects": "[1, 2]"}
    out = {}
    for name, text in files.items():
        (made / name).write_text(text)
        out[name] = str(made / name)
    (made / "latin1").write_bytes('{"query": "caf\xe9", "response": "x"}\n'.encode("latin-1"))
    out["latin1"] = str(made / "latin1")
    return out


# ----------------------------------------------------------------------------------------------
# The matrix: (script, argv) -> must fail in one line and change nothing
# ----------------------------------------------------------------------------------------------

MAINS = {"confadapt": confadapt.main, "bench_modes": bench_modes.main,
         "train_toy": lambda argv: run_cli(train_toy.main, argv), "finetune_hf": finetune_hf.main,
         "word_problem_base": lambda argv: run_cli(WORD_PROBLEM_BASE["main"], argv)}

NUMBERS = ["0", "-1", "x", "nan"]


def confadapt_cases(r, broken):
    run = ["--model", "base", "--prompt", "1 2"]
    cases = [[*run, flag, v] for flag in ("--max-new-tokens", "--k-max", "--static-k", "--threads") for v in NUMBERS]
    cases += [[*run, "--tau", v] for v in ("0", "1.5", "-0.1", "x", "nan")]
    cases += [[*run, "--device", "cuda"] if not torch.cuda.is_available() else [*run, "--device", "cuda:99"],
              [*run, "--device", "gpu"], [*run, "--dtype", "int8"], [*run, "--color", "pink"],
              [*run, "--static-k", "2", "--lossless"], [*run, "--static-k", "2", "--tau", "0.5"],
              [*run, "--greedy", "--k-max", "4"], [*run, "--png", "a_file/chunks.png"], [*run, "--unknown"],
              ["--model", "base"], ["--prompt", "1 2"], ["--model", "missing", "--prompt", "1"],
              ["--model", "a_file", "--prompt", "1"]]
    cases += [["--model", path, "--prompt", "1"] for path in broken.values()]
    bench = ["--model", "base", "--prompt", "1 2"]
    benches = [[*bench, flag, v] for flag in ("--max-new-tokens", "--batch-sizes", "--static-k", "--k-max",
                                              "--lossless-k", "--rows", "--repeats", "--latency-max") for v in NUMBERS]
    benches += [[*bench, "--taus", v] for v in ("0", "1.5", "x")] + [["--model", "base"]]
    return [("confadapt", c) for c in cases] + [("bench_modes", c) for c in benches]


def train_toy_cases(r):
    cases = [[flag, v] for flag in ("--teacher-steps", "--mtp-steps", "--n-eval", "--threads") for v in NUMBERS]
    cases += [["--seed", "-1"], ["--seed", "x"], ["--device", "cuda" if not torch.cuda.is_available() else "cuda:99"],
              ["--device", "gpu"], ["--out", "a_file"], ["--out", "a_file/run"], ["--unknown"],
              ["--export-hf", "a_file", *TOY], ["--export-hf", "hf", "--seed", "3", *TOY],     # nothing to export
              # a folder that holds another run: refused, whatever the difference
              ["--out", "runs/toy-teacher2-mtp1-eval1", "--quick", *TOY],
              ["--out", "runs/toy-teacher2-mtp1-eval1", "--seed", "1", *TOY],
              ["--out", "runs/toy-teacher2-mtp1-eval1", "--teacher-steps", "3", "--mtp-steps", "1", "--n-eval", "1"],
              ["--out", "runs/toy-teacher2-mtp1-eval1", "--teacher-steps", "2", "--mtp-steps", "1", "--n-eval", "2"],
              ["--out", "truncated_toy", *TOY], ["--out", "truncated_toy", "--export-hf", "hf", *TOY]]
    base = [["--out", "a_file"], [], ["--out", "wp2", "--seed", "-1"],
            ["--out", "wp2", "--device", "gpu"]]
    return [("train_toy", c) for c in cases] + [("word_problem_base", c) for c in base]


def finetune_cases(r, broken, bad):
    train = ["train", "--model", "base", "--data", "wp/train.json", "--out", "new", *TRAIN]
    cases = [[*train, flag, v] for flag in ("--steps", "--batch-size", "--micro-batch", "--regions", "--save-every",
                                            "--keep", "--log-every", "--lr", "--clip") for v in NUMBERS]
    cases += [[*train, flag, v] for flag, v in [
        ("--seq-len", "1"), ("--seq-len", "63"), ("--k-max", "1"), ("--k-max", "40"), ("--regions", "33"),
        ("--micro-batch", "3"), ("--warmup", "-1"), ("--decay", "-1"), ("--weight-decay", "-0.1"), ("--beta1", "1"),
        ("--beta2", "-0.5"), ("--limit-rows", "-1"), ("--seed", "-1"), ("--mode", "best"), ("--format", "chat"),
        ("--device", "gpu"), ("--threads", "0"), ("--threads", "x"), ("--dtype", "float16"),
        ("--prefix-ntp-weight", "-1"), ("--device", "cuda" if not torch.cuda.is_available() else "cuda:99")]]
    cases += [[*train, "--resume", "--overwrite"], [*train, "--unknown"], ["train", "--model", "base"]]
    paths = {"--model": ["missing", "a_file", *broken.values()], "--data": ["missing.json", "wp", *bad.values()],
             "--out": ["a_file", "a_file/run", "ft"]}                 # ft: a used folder, no --resume / --overwrite
    for flag, values in paths.items():
        for v in values:
            argv = list(train)
            argv[argv.index(flag) + 1] = v
            cases.append(argv)
    ft = ["train", "--model", "base", "--data", "wp/train.json", "--out", "ft", "--steps", "2", *TRAIN, "--resume"]
    cases += [[*ft, "--lr", "0.5"], [*ft, "--seed", "1"]]                # resume with other settings
    ev = ["eval", "--model", "base", "--data", "wp/test.jsonl", "--out", "ev"]
    cases += [[*ev, flag, v] for flag in ("--static-k", "--k-max", "--max-new-tokens", "--batch-size")
              for v in NUMBERS]
    cases += [[*ev, flag, v] for flag, v in [("--taus", "0"), ("--taus", "1.5"), ("--lossless-k", "-1"),
                                              ("--limit", "-1"), ("--n-shot", "9"), ("--n-shot", "-1"),
                                              ("--prompt-style", "fewest"), ("--out", "a_file"),
                                              ("--data", "missing.jsonl"), ("--data", "wp/train.json"),
                                              ("--model", "missing"), ("--reference", "missing"),
                                              ("--reference", "a_file")]]
    cases += [[*ev, "--static-k", "--taus"]]                               # nothing to evaluate
    an = ["analyze", "--model", "base", "--data", "wp/test.jsonl"]
    cases += [[*an, flag, v] for flag in ("--max-new-tokens", "--batch-size") for v in NUMBERS]
    cases += [[*an, flag, v] for flag, v in [("--taus", "0"), ("--taus", "1.5"), ("--taus", "x"), ("--k-max", "0"),
                                              ("--k-max", "1"), ("--limit", "-1"), ("--out", "a_file"),
                                              ("--data", "missing.jsonl"), ("--data", bad["wrong_rows"]),
                                              ("--data", bad["latin1"]), ("--model", broken["mistral"])]]
    cases += [[*an, "--domains", "lists"], ["analyze", "--model", "base", "--domains", "poetry"], an[:3]]
    rows = ["data", "--model", "base", "--out", "rows.jsonl", "--domains", "lists"]
    cases += [[*rows, flag, v] for flag in ("--per-domain", "--max-new-tokens", "--batch-size") for v in NUMBERS]
    cases += [[*rows, "--domains", "poetry"], [*rows, "--split", "dev"], [*rows, "--out", "wp"],
              [*rows, "--out", "a_file/rows.jsonl"], [*rows, "--model", "missing"], [*rows, "--device", "gpu"]]
    cases += [["export", "--checkpoint", c, "--out", "exp"] for c in ("missing", "a_file", "wp", "truncated")]
    cases += [["export", "--checkpoint", "ft", "--out", "a_file"], ["export", "--checkpoint", "ft"], ["serve"], [],
              ["export", "--checkpoint", "ft", "--out", "exp", "--threads", "0"]]
    # Nothing written over what the command did not make, nothing trained on nothing.
    cases += [["export", "--checkpoint", "ft", "--out", out] for out in ("base", "ft", "ft/final", "wp")]
    cases += [[*rows[:4], "wp/test.jsonl", *rows[5:]], [*ev[:-2], "--out", "base"], [*ev[:-2], "--out", "ft"],
              [*an, "--out", "wp"]]
    cases += [ev[:5]]                                  # the default decoders need a <mask>: base has none
    tr, targetless = ["train", "--model", "base", "--out", "o", *TRAIN], targetless_data_files(r)
    cases += [[*tr, "--data", targetless["empty_responses"], "--response-only"],
              [*tr, "--data", targetless["unfinished"]],
              [*tr, "--data", "wp/train.json", "--response-only", "--seq-len", "8"],
              ["train", "--model", "base", "--data", "wp/train.json", "--out", "ft", *TRAIN, "--steps", "1",
               "--resume"]]
    return [("finetune_hf", c) for c in cases]


def all_cases(r):
    broken, bad = broken_models(r), bad_data_files(r)
    toy = r / "runs" / "toy-teacher2-mtp1-eval1"
    if not (r / "truncated_toy").exists():                               # a toy checkpoint cut short
        shutil.copytree(toy, r / "truncated_toy")
        teacher = (toy / "checkpoints" / "teacher.pt").read_bytes()
        (r / "truncated_toy" / "checkpoints" / "teacher.pt").write_bytes(teacher[: len(teacher) // 3])
    if not (r / "truncated").exists():                                   # a checkpoint cut short mid-write
        latest = r / "ft" / "checkpoints" / (r / "ft" / "checkpoints" / "latest").read_text().strip()
        shutil.copytree(latest, r / "truncated")
        trainer = (r / "truncated" / "trainer.pt").read_bytes()
        (r / "truncated" / "trainer.pt").write_bytes(trainer[: len(trainer) // 2])
    return confadapt_cases(r, broken) + train_toy_cases(r) + finetune_cases(r, broken, bad)


def test_every_bad_input_fails_in_one_line_and_changes_nothing(at_root, capsys):
    cases = all_cases(at_root)
    before = snapshot(at_root)
    failures = []
    for script, argv in cases:
        status = MAINS[script](argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if status == 0 or len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in err:
            failures.append(f"{script} {' '.join(argv)} -> {status}: {err!r}")
    assert not failures, "\n".join(failures)
    assert snapshot(at_root) == before                                   # not one file written or touched
    assert len(cases) > 200


def test_error_lines_name_what_is_wrong(at_root, capsys):
    broken, bad = broken_models(at_root), bad_data_files(at_root)
    all_cases(at_root)
    expected = [
        ("confadapt", ["--model", "base", "--prompt", "1", "--tau", "1.5"], "--tau: must be in (0, 1], got 1.5"),
        ("confadapt", ["--model", "base", "--prompt", "1", "--device", "gpu"], "unknown device 'gpu'"),
        ("train_toy", ["--teacher-steps", "-5"], "--teacher-steps: must be at least 1, got -5"),
        ("train_toy", ["--out", "a_file"], "--out a_file: is a file"),
        ("train_toy", ["--export-hf", "hf", "--seed", "3", *TOY], "no finished teacher, naive, distill"),
        ("train_toy", ["--out", "runs/toy-teacher2-mtp1-eval1", "--quick", *TOY], "dim 128 -> 64"),
        ("word_problem_base", ["--out", "a_file"], "--out a_file: is a file"),
        ("finetune_hf", ["train", "--model", broken["no_config"], "--data", "x", "--out", "o"], "no model config"),
        ("finetune_hf", ["train", "--model", broken["mistral"], "--data", "x", "--out", "o"],
         "config.json: unsupported model_type 'mistral'"),
        ("finetune_hf", ["train", "--model", broken["a_list"], "--data", "x", "--out", "o"],
         "config.json: expected a JSON object"),
        ("finetune_hf", ["train", "--model", broken["no_heads"], "--data", "x", "--out", "o"],
         "config.json: missing field 'num_attention_heads'"),
        ("finetune_hf", ["train", "--model", broken["bad_tokenizer"], "--data", "wp/train.json", "--out", "o", *TRAIN],
         "tokenizer.json"),
        ("finetune_hf", ["train", "--model", "base", "--data", bad["latin1"], "--out", "o", *TRAIN],
         "latin1: not UTF-8"),
        ("finetune_hf", ["train", "--model", "base", "--data", "wp/train.json", "--out", "ft"],
         "add --resume to continue it, or --overwrite"),
        ("finetune_hf", ["train", "--model", "base", "--data", "wp/train.json", "--out", "o", "--steps", "0"],
         "--steps: must be at least 1, got 0"),
        ("finetune_hf", ["export", "--checkpoint", "truncated", "--out", "exp"], "truncated/trainer.pt: truncated"),
        ("finetune_hf", ["analyze", "--model", "base", "--data", "x", "--taus", "0"], "--taus: must be in (0, 1]"),
    ]
    if not torch.cuda.is_available():
        expected.append(("finetune_hf", ["eval", "--model", "base", "--data", "wp/test.jsonl", "--device", "cuda"],
                         "CUDA is not available on this machine"))
    for script, argv, message in expected:
        assert MAINS[script](argv) == 2
        err = capsys.readouterr().err
        assert message in err, (argv, err)


# ----------------------------------------------------------------------------------------------
# Runs are never mixed or lost
# ----------------------------------------------------------------------------------------------

def test_default_folders_are_named_after_the_settings():
    def out(*argv):
        args = train_toy.parse_args(list(argv))
        cfg = train_toy.RunConfig(seed=args.seed, **(train_toy.QUICK if args.quick else {}))
        for name in ("teacher_steps", "mtp_steps", "n_eval"):
            if getattr(args, name) is not None:
                cfg = train_toy.replace(cfg, **{name: getattr(args, name)})
        return train_toy.default_out(args, cfg)
    assert out() == out("--teacher-steps", "3000") == os.path.join("runs", "toy")
    assert out("--quick") == os.path.join("runs", "toy-quick")
    assert out("--seed", "1") == os.path.join("runs", "toy-seed1")
    assert out("--quick", "--seed", "2", "--n-eval", "3") == os.path.join("runs", "toy-quick-seed2-eval3")


def test_other_runs_leave_a_finished_toy_run_untouched(at_root):
    run = at_root / "runs" / "toy-teacher2-mtp1-eval1"
    checkpoints = snapshot(run / "checkpoints")
    results = json.loads((run / "results.json").read_text())
    others = set()
    for argv in (["--quick", *TOY], ["--seed", "1", *TOY]):           # into their own default folders
        train_toy.main(argv)
        others |= {p.name for p in (at_root / "runs").iterdir()}
        assert snapshot(run / "checkpoints") == checkpoints
        assert json.loads((run / "results.json").read_text()) == results
    assert {"toy-quick-teacher2-mtp1-eval1", "toy-seed1-teacher2-mtp1-eval1"} <= others

    again = train_toy.main(TOY)                                      # the same run again: nothing retrained
    assert snapshot(run / "checkpoints") == checkpoints
    timing = {"tokens_per_s"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in again["rows"]] == \
        [{k: v for k, v in r.items() if k not in timing} for r in results["rows"]]


def test_finetune_resume_compares_paths_by_meaning_and_overwrite_replaces(at_root, capsys, tmp_path):
    shutil.copytree(at_root / "ft", tmp_path / "ft")
    shutil.copytree(at_root / "base", tmp_path / "base")
    shutil.copytree(at_root / "wp", tmp_path / "wp")
    os.chdir(tmp_path)
    absolute = ["train", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "wp" / "train.json"),
                "--out", "ft", "--steps", "3", *TRAIN]
    assert finetune_hf.main([*absolute, "--resume"]) == 0           # first run: relative paths, now absolute
    assert "resumed from" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (tmp_path / "ft" / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert finetune_hf.main([*absolute, "--steps", "1", "--overwrite"]) == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "ft" / "log.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (tmp_path / "ft" / "checkpoints").glob("step_*")) == ["step_000001"]


def test_warmup_longer_than_the_run_is_announced(at_root, capsys, tmp_path):
    assert finetune_hf.main(["train", "--model", "base", "--data", "wp/train.json", "--out", str(tmp_path / "w"),
                             *TRAIN, "--steps", "1", "--warmup", "2000"]) == 0
    out = capsys.readouterr().out
    assert "warning: --warmup 2000 is over half of --steps 1: the learning rate only reaches 0.05% of --lr" in out


# ----------------------------------------------------------------------------------------------
# Ctrl-C: one line, saying what is saved and how to continue
# ----------------------------------------------------------------------------------------------

def interrupted_at_call(n: int, real):
    """`real`, except that its n-th call raises KeyboardInterrupt: Ctrl-C there."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    return wrapped


def test_ctrl_c_in_finetune_says_how_to_resume(at_root, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(finetune_hf, "train_step", interrupted_at_call(2, finetune_hf.train_step))
    out = tmp_path / "cut"
    assert finetune_hf.main(["train", "--model", "base", "--data", "wp/train.json", "--out", str(out), "--steps", "3",
                             *TRAIN]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"interrupted: the last checkpoint is {out / 'checkpoints' / 'step_000001'}; "
                   f"run the same command with --resume to continue")


def test_ctrl_c_in_the_toy_says_what_is_saved(at_root, capsys, monkeypatch):
    real = train_toy.train_phase

    def interrupted_students(name, *args, **kwargs):
        if name == "naive":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)
    monkeypatch.setattr(train_toy, "train_phase", interrupted_students)
    assert MAINS["train_toy"](["--seed", "5", *TOY]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"interrupted: {os.path.join('runs', 'toy-seed5-teacher2-mtp1-eval1')}/checkpoints holds "
                   f"teacher; run the same command again to continue from there")


# ----------------------------------------------------------------------------------------------
# No command writes over what it did not make; interrupted work keeps what it finished
# ----------------------------------------------------------------------------------------------

def test_export_writes_a_new_folder_and_replaces_only_its_own(at_root, capsys, tmp_path):
    out = tmp_path / "exp"
    assert finetune_hf.main(["export", "--checkpoint", "ft", "--out", str(out)]) == 0
    assert (out / "generation_config.json").read_text() == (at_root / "base" / "generation_config.json").read_text()
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~umask}   # safetensors' too
    assert finetune_hf.main(["export", "--checkpoint", "ft", "--out", str(out)]) == 2
    assert "holds an earlier export's output: add --overwrite" in capsys.readouterr().err
    assert finetune_hf.main(["export", "--checkpoint", "ft", "--out", str(out), "--overwrite"]) == 0
    for foreign in ("base", "ft"):                      # a model it did not write, a run: never
        assert finetune_hf.main(["export", "--checkpoint", "ft", "--out", foreign, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "holds a model that export did not write" in err and "holds a training run" in err


def test_data_keeps_finished_domains_on_ctrl_c_and_never_replaces_a_file_unasked(at_root, capsys, monkeypatch,
                                                                                  tmp_path):
    real = finetune_hf.generate
    monkeypatch.setattr(finetune_hf, "generate", interrupted_at_call(2, real))    # in the second domain
    rows = tmp_path / "rows.jsonl"
    argv = ["data", "--model", "base", "--out", str(rows), "--domains", "lists", "writing", "--per-domain", "2",
            "--max-new-tokens", "4"]
    assert finetune_hf.main(argv) == 130
    assert capsys.readouterr().err.strip() == (f"interrupted: {rows} holds the 2 rows of lists; writing and the "
                                               "domains after it were not made")
    assert [json.loads(line)["domain"] for line in rows.read_text().splitlines()] == ["lists", "lists"]
    monkeypatch.setattr(finetune_hf, "generate", real)
    assert finetune_hf.main(argv) == 2                                  # the rows are kept
    assert finetune_hf.main([*argv, "--overwrite"]) == 0
    assert len(rows.read_text().splitlines()) == 4


def test_eval_checks_its_decoders_first_and_keeps_finished_ones_on_ctrl_c(at_root, capsys, monkeypatch, tmp_path):
    out = tmp_path / "ev"
    argv = ["eval", "--model", "ft/final", "--data", "wp/test.jsonl", "--out", str(out), "--prompt-style",
            "zeroshot", "--max-new-tokens", "4", "--static-k", "1", "2", "--taus"]
    monkeypatch.setattr(finetune_hf, "generate", interrupted_at_call(2, finetune_hf.generate))  # 2nd decoder
    assert finetune_hf.main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1].startswith("| decoding |")      # the header comes first
    assert captured.err.strip() == f"interrupted: {out} holds the results of the 1 finished decoder(s)"
    assert [r["decoding"] for r in json.loads((out / "results.json").read_text())["results"]] == ["k=1 (greedy)"]
    assert finetune_hf.build_parser().parse_args(argv[:5]).out == os.path.join("runs", "gsm8k_eval")


def test_eval_shows_progress_within_a_decoder(at_root, capsys, tmp_path):
    data.write_word_problems(tmp_path / "wp", n_train=1, n_test=6, seed=3)
    assert finetune_hf.main(["eval", "--model", "ft/final", "--data", str(tmp_path / "wp" / "test.jsonl"),
                             "--out", str(tmp_path / "ev"), "--prompt-style", "zeroshot", "--max-new-tokens", "2",
                             "--batch-size", "1", "--static-k", "1", "--taus"]) == 0
    assert "greedy: 4/6 answers" in capsys.readouterr().err           # parts of 4 batches of 1


# ----------------------------------------------------------------------------------------------
# Training on nothing is refused; resuming continues the run
# ----------------------------------------------------------------------------------------------

def test_training_on_nothing_is_refused_with_its_cause(at_root, capsys):
    bad = targetless_data_files(at_root)
    tr = ["train", "--model", "base", "--out", "o", *TRAIN]
    assert finetune_hf.main([*tr, "--data", bad["empty_responses"], "--response-only"]) == 2
    assert "no training targets" in capsys.readouterr().err
    assert finetune_hf.main([*tr, "--data", "wp/train.json", "--response-only", "--seq-len", "8"]) == 2
    assert "8 rows are cut by --seq-len 8 before their response starts" in capsys.readouterr().err
    assert finetune_hf.main([*tr, "--data", bad["unfinished"]]) == 2
    assert "marked unfinished: nothing to train on" in capsys.readouterr().err


def test_unfinished_rows_are_skipped_and_rows_without_targets_announced(at_root, capsys, tmp_path):
    bad = targetless_data_files(at_root)
    assert finetune_hf.main(["train", "--model", "base", "--out", str(tmp_path / "t"), *TRAIN, "--steps", "1",
                             "--response-only", "--data", "wp/train.json", bad["unfinished"],
                             bad["empty_responses"]]) == 0
    out = capsys.readouterr().out
    assert "skipped 3 rows marked unfinished" in out
    assert "warning: 3 of 11 rows give no target (0 rows are cut by --seq-len 32 before their response starts " \
           "and 3 have an empty response)" in out
    assert "GB; the last 2 are kept" in out


def test_a_full_scale_run_on_a_cpu_says_so_before_its_first_step(at_root, capsys, monkeypatch, tmp_path):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(finetune_hf, "train_step", stop)
    assert finetune_hf.main(["train", "--model", "base", "--data", "wp/train.json", "--out",
                             str(tmp_path / "big"), "--micro-batch", "2", "--seq-len", "32"]) == 130
    out = capsys.readouterr().out
    assert "100,000 steps of 128 sequences of 32 tokens" in out
    assert "note: that is 12,800,000 sequences, the scale of the paper's multi-GPU recipe" in out


def test_resume_to_more_steps_continues_the_schedule_and_fewer_is_refused(at_root, capsys, tmp_path):
    def run(out, steps, *extra):
        return finetune_hf.main(["train", "--model", "base", "--data", "wp/train.json", "--out", str(out), *TRAIN,
                                 "--steps", str(steps), "--seed", "1", *extra])
    assert run(tmp_path / "straight", 6) == 0
    assert run(tmp_path / "cut", 4) == 0
    assert run(tmp_path / "cut", 6, "--resume") == 0
    assert "steps 1-4 followed the schedule of a 4-step run" in capsys.readouterr().out
    logs = [[json.loads(line) for line in (tmp_path / run_ / "log.jsonl").read_text().splitlines()]
            for run_ in ("straight", "cut")]
    assert [r["lr"] for r in logs[0]] == [r["lr"] for r in logs[1]]      # step 5 is not at rate 0
    assert logs[0][-1]["loss"] == pytest.approx(logs[1][-1]["loss"], rel=1e-5)
    assert run(tmp_path / "cut", 3, "--resume") == 2
    assert "has done 6 steps already; resume it with --steps 6 or more" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# The decoding command line speaks the model's prompt format; smaller things
# ----------------------------------------------------------------------------------------------

def test_confadapt_formats_the_prompt_as_asked(at_root, capsys, tmp_path):
    tok = data.Tokenizer.from_pretrained(at_root / "ft" / "final")
    base = ["--model", "ft/final", "--prompt", "Tom has 3 pens.", "--greedy", "--max-new-tokens", "2", "--json"]
    for fmt, want in [("auto", [tok.bos_id, *tok.encode("Tom has 3 pens.")]),        # no chat tokens: raw
                      ("raw", [tok.bos_id, *tok.encode("Tom has 3 pens.")]),
                      ("plain", data.prompt_tokens(tok, "plain", "Tom has 3 pens."))]:
        assert confadapt.main([*base, "--format", fmt]) == 0
        assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(want), fmt
    png = tmp_path / "new" / "folder" / "chunks.png"                       # a folder to make, after decoding
    assert confadapt.main([*base[:-1], "--png", str(png)]) == 0 and png.is_file()
    assert confadapt.main([*base[:5], "--max-new-tokens", "500"]) == 0
    assert "stopped at the end of the model's context (64 tokens)" in capsys.readouterr().err


def test_help_says_what_max_new_tokens_and_dtype_do(capsys):
    for command in ("eval", "analyze", "data"):
        with pytest.raises(SystemExit):
            finetune_hf.build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "most tokens of each answer" in text and "auto (the default): bfloat16" in text


def test_analyze_calls_its_estimate_a_floor(at_root, capsys):
    assert finetune_hf.main(["analyze", "--model", "base", "--domains", "lists", "--limit", "2",
                             "--max-new-tokens", "4", "--taus", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "a floor: tuning sharpens confidences" in out or "predictable enough" in out
    assert "little to gain" not in out


def test_auto_dtype_is_bfloat16_only_on_a_gpu_that_computes_it(monkeypatch):
    """--dtype auto: float32 on the CPU and on GPUs that only emulate bfloat16 (a T4 or V100,
    where torch.cuda.is_bf16_supported() says yes by default), bfloat16 from Ampere on."""
    cuda = torch.device("cuda")
    assert parse_dtype("auto", torch.device("cpu")) == torch.float32
    def t4(including_emulation=True):
        return including_emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", t4)
    assert parse_dtype("auto", cuda) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert parse_dtype("auto", cuda) == torch.bfloat16                               # an A100
    assert parse_dtype("float32", cuda) == torch.float32


def test_provenance_names_commit_cpu_dtype_torch_and_threads(monkeypatch):
    import subprocess

    here = provenance(torch.bfloat16)
    assert set(here) == {"commit", "cpu", "dtype", "torch", "threads"}
    assert here["dtype"] == "bfloat16"
    assert here["cpu"] and here["torch"] == torch.__version__
    assert here["threads"] == torch.get_num_threads()
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(subprocess, "run", no_git)
    assert provenance(torch.float32)["commit"] is None                      # no git: None, no error


def test_device_names():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("auto") == torch.device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""      # conftest: the default suite sees no GPU
    for name, message in [("cuda:0", "CUDA is not available"), ("cuda", "CUDA is not available"),
                          ("gpu", "unknown device"), ("cuda:x", "unknown device"),
                          ("mps", "unknown device")]:
        with pytest.raises(ValueError, match=message) as err:
            parse_device(name)
        assert "\n" not in str(err.value)
