"""What the command lines do with what a user gives them.

Every bad value of every flag, and every broken file or folder, ends in one line `error: ...` on
stderr and a non-zero exit status, with no traceback, and leaves every existing run folder as it
was (each file's bytes and modification time). Ctrl-C ends in one line saying how to go on. And a
run never lands in another run's folder: a second run, a --quick run and a run with another seed
leave a finished run's checkpoints and results alone.

The lessons' commands are called in-process (main(argv) through mtp.cli.run_cli, what
`python X.py` runs); the scripts (benchmarks/bench_modes.py, scripts/word_problem_base.py) run
as a user runs them, each in a process of its own. All of them run on a tiny model written here
and two tiny finished runs, so the whole file takes seconds.
"""
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from matplotlib.image import imread

import confadapt
import finetune_hf
import train_toy
from conftest import ONE_LAYER, run_script, tiny_model
from mtp import cli, finetune_cli, training_rows
from mtp.cli import parse_device, parse_dtype, provenance, run_cli
from tasks import gsm8k
from mtp.tokenizer import Tokenizer, prompt_tokens
from tasks.word_problems import word_problem_tokenizer, write_word_problems
from mtp.hf import save_pretrained

REPO = Path(__file__).resolve().parents[1]

# The scripts, run as files in processes of their own: no test imports a script.
SCRIPTS = {
    "bench_modes": REPO / "benchmarks" / "bench_modes.py",
    "word_problem_base": REPO / "scripts" / "word_problem_base.py",
}

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")

# The toy run of the tests: the full-size model for a few steps, one prompt per task.
TOY = "--teacher-steps 2 --mtp-steps 1 --n-eval 1"

# ... and the folder it goes to by default
TOY_RUN = "runs/toy-teacher2-mtp1-eval1"

# finetune_hf's training settings in the tests: two rows of 32 tokens a step
TRAIN = "--seq-len 32 --batch-size 2 --micro-batch 2 --k-max 4 --warmup 1 --save-every 1"

# a GPU this machine does not have
NO_SUCH_GPU = "cuda" if not torch.cuda.is_available() else "cuda:99"


def argv(command: str) -> list[str]:
    """The words of a command line, split as the shell splits them."""
    return shlex.split(command)


# ----------------------------------------------------------------------------------------------
# The folder every test runs in: a tiny model, word problems, two finished runs, broken inputs
# ----------------------------------------------------------------------------------------------

def write_base_model(folder, logit_scale=1.0):
    """A tiny model in Hugging Face layout, with the word problems' tokenizer and no <mask>.

    logit_scale multiplies the output layer: at 1000 every top-1 probability is about 1."""
    tok = word_problem_tokenizer()
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    model = tiny_model(tok.n_vocab, **ONE_LAYER, **ids)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    save_pretrained(model, folder)
    tok.save_pretrained(folder)
    generation = json.dumps({"eos_token_id": tok.eos_id}) + "\n"
    (folder / "generation_config.json").write_text(generation)


def break_models(root):
    """Model folders broken in each way a user can break one, beside the good one."""
    base = root / "base"
    config = json.loads((base / "config.json").read_text())
    no_heads = {k: v for k, v in config.items() if k != "num_attention_heads"}
    configs = {
        "no_config": None,
        "bad_json": "{not json",
        "a_list": "[1, 2]",
        "mistral": json.dumps({**config, "model_type": "mistral"}),
        "no_heads": json.dumps(no_heads),
        "bad_tokenizer": json.dumps(config),
    }
    for name, text in configs.items():
        folder = root / "broken" / name
        shutil.copytree(base, folder)
        if text is None:
            (folder / "config.json").unlink()
        else:
            (folder / "config.json").write_text(text)
    (root / "broken" / "bad_tokenizer" / "tokenizer.json").write_bytes(b'{"model": {"vocab": ')


BROKEN_MODELS = [
    "broken/no_config",
    "broken/bad_json",
    "broken/a_list",
    "broken/mistral",
    "broken/no_heads",
    "broken/bad_tokenizer",
]


def write_bad_data(root):
    """Data files that are not rows to train on."""
    folder = root / "bad_data"
    folder.mkdir()
    (folder / "wrong_rows").write_text('{"instruction": "x", "output": "y"}\n')
    (folder / "bad_json").write_text('[{"query": "x",')
    (folder / "empty").write_text("")
    (folder / "not_objects").write_text("[1, 2]")
    latin1 = '{"query": "caf\xe9", "response": "x"}\n'.encode("latin-1")
    (folder / "latin1").write_bytes(latin1)


BAD_DATA = [
    "bad_data/wrong_rows",
    "bad_data/bad_json",
    "bad_data/empty",
    "bad_data/not_objects",
    "bad_data/latin1",
]


def write_targetless_data(root):
    """Well-formed rows that give nothing to train on: empty responses (with --response-only),
    answers that `data` marked unfinished."""
    folder = root / "targetless"
    folder.mkdir()
    empty = {"prompt": "Tom has 3 pens.", "response": ""}
    unfinished = {"prompt": "Tom has 3 pens.", "response": "He", "finished": False}
    (folder / "empty_responses").write_text((json.dumps(empty) + "\n") * 3)
    (folder / "unfinished").write_text((json.dumps(unfinished) + "\n") * 3)


def cut_short(path, keep):
    """Keep the first share `keep` of a file's bytes: a write that stopped halfway."""
    whole = path.read_bytes()
    path.write_bytes(whole[: int(len(whole) * keep)])


def write_truncated_checkpoints(root):
    # a toy run whose teacher checkpoint is cut short
    shutil.copytree(root / TOY_RUN, root / "truncated_toy")
    cut_short(root / "truncated_toy" / "checkpoints" / "teacher.pt", 1 / 3)
    # a finetune_hf checkpoint cut short mid-write
    checkpoints = root / "ft" / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    shutil.copytree(latest, root / "truncated")
    cut_short(root / "truncated" / "trainer.pt", 1 / 2)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The folder the commands run in.

    base/: a tiny model with no <mask> (Hugging Face layout); wp/: word problems; ft/: a
    finished finetune_hf run; runs/toy-teacher2-mtp1-eval1: a finished toy run (its default
    folder); a_file: a file; and broken models, bad data and checkpoints cut short."""
    root = tmp_path_factory.mktemp("cli")
    write_base_model(root / "base")
    write_word_problems(root / "wp", n_train=8, n_test=2, seed=0)
    (root / "a_file").write_text("not a folder\n")
    train = f"train --model base --data wp/train.json --out ft --steps 2 {TRAIN}"
    with pytest.MonkeyPatch.context() as patch:
        # the toy's default folders are relative: runs/...
        patch.chdir(root)
        assert finetune_hf.main(argv(train)) == 0
        train_toy.main(argv(TOY))
    assert (root / TOY_RUN / "results.json").is_file()
    break_models(root)
    write_bad_data(root)
    write_targetless_data(root)
    write_truncated_checkpoints(root)
    return root


@pytest.fixture
def at_root(root, monkeypatch):
    monkeypatch.chdir(root)
    return root


def snapshot(folder) -> dict:
    """Every file under `folder`: its bytes and its modification time."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


# ----------------------------------------------------------------------------------------------
# The matrix: (command, argv) -> must fail in one line and change nothing
# ----------------------------------------------------------------------------------------------

MAINS = {
    "confadapt": confadapt.main,
    "train_toy": lambda args: run_cli(train_toy.main, args),
    "finetune_hf": finetune_hf.main,
}

NUMBERS = ["0", "-1", "x", "nan"]


def every_bad_number(command, flags):
    """`command` with each flag set to each bad number."""
    return [f"{command} {flag} {v}" for flag in flags for v in NUMBERS]


def confadapt_cases():
    run = "--model base --prompt '1 2'"
    numbers = ("--max-new-tokens", "--k-max", "--static-k", "--threads")
    cases = every_bad_number(run, numbers)
    cases += [f"{run} --tau {v}" for v in ("0", "1.5", "-0.1", "x", "nan")]
    cases += [
        f"{run} --device {NO_SUCH_GPU}",
        f"{run} --device gpu",
        f"{run} --dtype int8",
        f"{run} --color pink",
        f"{run} --static-k 2 --lossless",
        f"{run} --static-k 2 --tau 0.5",
        f"{run} --greedy --k-max 4",
        f"{run} --format chatml",
        f"{run} --format llama3-chat",
        f"{run} --base ft/final",
        f"{run} --png a_file/chunks.png",
        f"{run} --unknown",
        "--model base",
        "--prompt '1 2'",
        "--model missing --prompt 1",
        "--model a_file --prompt 1",
    ]
    cases += [f"--model {path} --prompt 1" for path in BROKEN_MODELS]
    return [("confadapt", c) for c in cases]


def train_toy_cases():
    numbers = ("--teacher-steps", "--mtp-steps", "--n-eval", "--threads")
    cases = every_bad_number("", numbers)
    cases += [
        "--seed -1",
        "--seed x",
        f"--device {NO_SUCH_GPU}",
        "--device gpu",
        "--out a_file",
        "--out a_file/run",
        "--unknown",
        f"--export-hf a_file {TOY}",
        # nothing to export
        f"--export-hf hf --seed 3 {TOY}",
        # a folder that holds another run: refused, whatever the difference
        f"--out {TOY_RUN} --quick {TOY}",
        f"--out {TOY_RUN} --seed 1 {TOY}",
        f"--out {TOY_RUN} --teacher-steps 3 --mtp-steps 1 --n-eval 1",
        f"--out {TOY_RUN} --teacher-steps 2 --mtp-steps 1 --n-eval 2",
        f"--out truncated_toy {TOY}",
        f"--out truncated_toy --export-hf hf {TOY}",
    ]
    return [("train_toy", c) for c in cases]


BAD_TRAIN_SETTINGS = [
    "--seq-len 1",
    "--seq-len 63",
    "--k-max 1",
    "--k-max 40",
    "--regions 33",
    "--micro-batch 3",
    "--warmup -1",
    "--decay -1",
    "--weight-decay -0.1",
    "--beta1 1",
    "--beta2 -0.5",
    "--limit-rows -1",
    "--seed -1",
    "--mode best",
    "--format chat",
    "--device gpu",
    "--threads 0",
    "--threads x",
    "--dtype float16",
    "--prefix-ntp-weight -1",
    f"--device {NO_SUCH_GPU}",
]


def train_with(model="base", data="wp/train.json", out="new"):
    return f"train --model {model} --data {data} --out {out} {TRAIN}"


def train_cases():
    train = train_with()
    numbers = ("--steps", "--batch-size", "--micro-batch", "--regions", "--save-every",
               "--keep", "--log-every", "--lr", "--clip")
    cases = every_bad_number(train, numbers)
    cases += [f"{train} {setting}" for setting in BAD_TRAIN_SETTINGS]
    cases += [
        f"{train} --resume --overwrite",
        f"{train} --unknown",
        f"{train} --format chatml",
        f"{train} --adapter-rank 8",
        f"{train} --adapter-alpha 8",
        f"{train} --adapter-targets wq",
        "train --model base",
    ]
    cases += [train_with(model=m) for m in ["missing", "a_file", *BROKEN_MODELS]]
    cases += [train_with(data=d) for d in ["missing.json", "wp", *BAD_DATA]]
    # ft: a used folder, and no --resume or --overwrite
    cases += [train_with(out=o) for o in ["a_file", "a_file/run", "ft"]]
    # resume with other settings
    ft = f"train --model base --data wp/train.json --out ft --steps 2 {TRAIN} --resume"
    cases += [f"{ft} --lr 0.5", f"{ft} --seed 1"]
    return cases


BAD_EVAL_SETTINGS = [
    "--taus 0",
    "--taus 1.5",
    "--lossless-k -1",
    "--limit -1",
    "--n-shot 9",
    "--n-shot -1",
    "--prompt-style fewest",
    "--out a_file",
    "--data missing.jsonl",
    "--data wp/train.json",
    "--model missing",
    "--reference missing",
    "--reference a_file",
    "--format llama3-chat",
    "--tolerance -1",
    "--tolerance x",
    "--tolerance 2 --static-k 2",
]

BAD_ANALYZE_SETTINGS = [
    "--taus 0",
    "--taus 1.5",
    "--taus x",
    "--k-max 0",
    "--k-max 1",
    "--limit -1",
    "--out a_file",
    "--data missing.jsonl",
    "--data bad_data/wrong_rows",
    "--data bad_data/latin1",
    "--model broken/mistral",
    "--format qwen",
]


def eval_and_analyze_cases():
    ev = "eval --model base --data wp/test.jsonl --out ev"
    numbers = ("--static-k", "--k-max", "--max-new-tokens", "--batch-size")
    cases = every_bad_number(ev, numbers)
    cases += [f"{ev} {setting}" for setting in BAD_EVAL_SETTINGS]
    # nothing to evaluate
    cases += [f"{ev} --static-k --taus"]
    an = "analyze --model base --data wp/test.jsonl"
    cases += every_bad_number(an, ("--max-new-tokens", "--batch-size"))
    cases += [f"{an} {setting}" for setting in BAD_ANALYZE_SETTINGS]
    cases += [
        f"{an} --domains lists",
        "analyze --model base --domains poetry",
        "analyze --model base",
    ]
    return cases


def data_and_export_cases():
    rows = "data --model base --out rows.jsonl --domains lists"
    cases = every_bad_number(rows, ("--per-domain", "--max-new-tokens", "--batch-size"))
    cases += [
        f"{rows} --domains poetry",
        f"{rows} --split dev",
        f"{rows} --out wp",
        f"{rows} --out a_file/rows.jsonl",
        f"{rows} --model missing",
        f"{rows} --device gpu",
        f"{rows} --format chatml",
    ]
    checkpoints = ("missing", "a_file", "wp", "truncated")
    cases += [f"export --checkpoint {c} --out exp" for c in checkpoints]
    cases += [
        "export --checkpoint ft --out a_file",
        "export --checkpoint ft",
        "serve",
        "",
        "export --checkpoint ft --out exp --threads 0",
    ]
    return cases


def nothing_over_what_is_not_theirs_cases():
    """Nothing written over what the command did not make, nothing trained on nothing."""
    cases = [f"export --checkpoint ft --out {out}" for out in ("base", "ft", "ft/final", "wp")]
    cases += [
        "data --model base --out wp/test.jsonl --domains lists",
        "eval --model base --data wp/test.jsonl --out base",
        "eval --model base --data wp/test.jsonl --out ft",
        "analyze --model base --data wp/test.jsonl --out wp",
        # the default decoders need a <mask>: base has none
        "eval --model base --data wp/test.jsonl",
    ]
    tr = f"train --model base --out o {TRAIN}"
    cases += [
        f"{tr} --data targetless/empty_responses --response-only",
        f"{tr} --data targetless/unfinished",
        f"{tr} --data wp/train.json --response-only --seq-len 8",
        f"train --model base --data wp/train.json --out ft {TRAIN} --steps 1 --resume",
    ]
    return cases


def finetune_cases():
    cases = train_cases()
    cases += eval_and_analyze_cases()
    cases += data_and_export_cases()
    cases += nothing_over_what_is_not_theirs_cases()
    return [("finetune_hf", c) for c in cases]


# The scripts' cases: every benchmark flag once (its values are the shared types of mtp.cli,
# which the lessons' cases above try with every bad number), every word_problem_base case.
SCRIPT_CASES = [
    ("bench_modes", "--model base --prompt '1 2' --max-new-tokens 0"),
    ("bench_modes", "--model base --prompt '1 2' --batch-sizes -1"),
    ("bench_modes", "--model base --prompt '1 2' --static-k x"),
    ("bench_modes", "--model base --prompt '1 2' --k-max nan"),
    ("bench_modes", "--model base --prompt '1 2' --lossless-k 0"),
    ("bench_modes", "--model base --prompt '1 2' --rows -1"),
    ("bench_modes", "--model base --prompt '1 2' --repeats x"),
    ("bench_modes", "--model base --prompt '1 2' --latency-max nan"),
    ("bench_modes", "--model base --prompt '1 2' --format chatml"),
    ("bench_modes", "--model base --prompt '1 2' --taus 1.5"),
    ("bench_modes", "--model base"),
    ("word_problem_base", "--out a_file"),
    ("word_problem_base", ""),
    ("word_problem_base", "--out wp2 --seed -1"),
    ("word_problem_base", "--out wp2 --device gpu"),
]


def in_process(command, words):
    """Run a lesson's main in this process -> (exit status, what it wrote to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = MAINS[command](words)
    return status, err.getvalue()


def as_a_process(script, words, cwd):
    """Run a script as a user does, `python SCRIPT ARGS` -> (exit status, its stderr)."""
    command = [sys.executable, str(SCRIPTS[script]), *words]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def fails_in_one_line(status, err):
    lines = err.strip().splitlines()
    one_line = len(lines) == 1 and lines[0].startswith("error: ")
    return status != 0 and one_line and "Traceback" not in err


@pytest.fixture(scope="module")
def matrix(root):
    """Every bad case run once in the root folder: the cases that did not fail in one line,
    and every file of the folder before and after."""
    lessons = confadapt_cases() + train_toy_cases() + finetune_cases()
    before = snapshot(root)
    outcomes = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for command, line in lessons:
            outcomes[command, line] = in_process(command, argv(line))
    for script, line in SCRIPT_CASES:
        outcomes[script, line] = as_a_process(script, argv(line), cwd=root)
    after = snapshot(root)
    failures = []
    for (command, line), (status, err) in outcomes.items():
        if not fails_in_one_line(status, err):
            failures.append(f"{command} {line} -> {status}: {err!r}")
    cases = lessons + SCRIPT_CASES
    return SimpleNamespace(cases=cases, outcomes=outcomes, failures=failures, before=before,
                           after=after)


def test_the_matrix_holds_over_200_bad_inputs(matrix):
    assert len(matrix.cases) > 200


def test_every_bad_input_fails_in_one_error_line(matrix):
    assert not matrix.failures, "\n".join(matrix.failures)


def test_no_bad_input_writes_or_touches_a_file(matrix):
    assert matrix.after == matrix.before


# a broken model fails first: this data and this folder are never read
UNREAD = "--data x --out o"

ERROR_LINES = [
    ("confadapt", "--model base --prompt 1 --tau 1.5", "--tau: must be in (0, 1], got 1.5"),
    ("confadapt", "--model base --prompt 1 --device gpu", "unknown device 'gpu'"),
    ("train_toy", "--teacher-steps -5", "--teacher-steps: must be at least 1, got -5"),
    ("train_toy", "--out a_file", "--out a_file: is a file"),
    ("train_toy", f"--export-hf hf --seed 3 {TOY}", "no finished teacher, naive, distill"),
    ("train_toy", f"--out {TOY_RUN} --quick {TOY}", "dim 128 -> 64"),
    ("word_problem_base", "--out a_file", "--out a_file: is a file"),
    ("finetune_hf", f"train --model broken/no_config {UNREAD}", "no model config"),
    ("finetune_hf", f"train --model broken/mistral {UNREAD}",
     "config.json: unsupported model_type 'mistral'"),
    ("finetune_hf", f"train --model broken/a_list {UNREAD}",
     "config.json: expected a JSON object"),
    ("finetune_hf", f"train --model broken/no_heads {UNREAD}",
     "config.json: missing field 'num_attention_heads'"),
    ("finetune_hf", train_with(model="broken/bad_tokenizer", out="o"), "tokenizer.json"),
    ("finetune_hf", train_with(data="bad_data/latin1", out="o"), "latin1: not UTF-8"),
    ("finetune_hf", "train --model base --data wp/train.json --out ft",
     "add --resume to continue it, or --overwrite"),
    ("finetune_hf", "train --model base --data wp/train.json --out o --steps 0",
     "--steps: must be at least 1, got 0"),
    ("finetune_hf", "export --checkpoint truncated --out exp", "truncated/trainer.pt: truncated"),
    ("finetune_hf", "analyze --model base --data x --taus 0", "--taus: must be in (0, 1]"),
    # a format the tokenizer has no special tokens for: those it has, before any weights
    ("confadapt", "--model base --prompt 1 --format chatml",
     "--format chatml: the tokenizer in base has not its special tokens; it supports plain, raw"),
    ("finetune_hf", train_with(out="o") + " --format llama3-chat", "it supports plain"),
    ("finetune_hf", "eval --model base --data wp/test.jsonl --format chatml", "it supports plain"),
    ("finetune_hf", "analyze --model base --data wp/test.jsonl --format qwen",
     "it supports plain"),
    ("finetune_hf", "data --model base --out r.jsonl --format chatml", "it supports plain"),
    ("bench_modes", "--model base --prompt '1 2' --format chatml", "it supports plain, raw"),
    ("confadapt", "--model base --prompt 1 --base ft/final",
     "--model base is not a gated mask adapter"),
    # adapter-only flags without the adapter would silently tune every weight
    ("finetune_hf", train_with(out="o") + " --adapter-rank 8",
     "--adapter-rank applies to --adapter gated-lora only"),
    ("finetune_hf", train_with(out="o") + " --adapter-targets wq up",
     "--adapter-targets applies to --adapter gated-lora only"),
    ("finetune_hf", "eval --model ft/final --data wp/test.jsonl --tolerance 1 --static-k 2",
     "--tolerance compares with k=1's accuracy"),
]
if not torch.cuda.is_available():
    ERROR_LINES.append(("finetune_hf", "eval --model base --data wp/test.jsonl --device cuda",
                        "CUDA is not available on this machine"))


@pytest.mark.parametrize("command,line,message", ERROR_LINES)
def test_error_lines_name_what_is_wrong(at_root, matrix, command, line, message):
    # a script's case: what it said in the matrix, one process less
    if command in SCRIPTS:
        status, err = matrix.outcomes[command, line]
    else:
        status, err = in_process(command, argv(line))
    assert status == 2
    assert message in err, err


# ----------------------------------------------------------------------------------------------
# Runs are never mixed or lost
# ----------------------------------------------------------------------------------------------

def default_out(command):
    """The folder a toy run with these flags writes to when --out is not given."""
    args = train_toy.parse_args(argv(command))
    quick = train_toy.QUICK if args.quick else {}
    cfg = train_toy.RunConfig(seed=args.seed, **quick)
    for name in ("teacher_steps", "mtp_steps", "n_eval"):
        value = getattr(args, name)
        if value is not None:
            cfg = train_toy.replace(cfg, **{name: value})
    return train_toy.default_out(args, cfg)


def test_default_folders_are_named_after_the_settings():
    toy = os.path.join("runs", "toy")
    assert default_out("") == toy
    # the full run's own teacher steps: the same folder
    assert default_out("--teacher-steps 3000") == toy
    assert default_out("--quick") == os.path.join("runs", "toy-quick")
    assert default_out("--seed 1") == os.path.join("runs", "toy-seed1")
    quick_seed2 = os.path.join("runs", "toy-quick-seed2-eval3")
    assert default_out("--quick --seed 2 --n-eval 3") == quick_seed2


def test_other_runs_leave_a_finished_toy_run_untouched(at_root):
    run = at_root / TOY_RUN
    checkpoints = snapshot(run / "checkpoints")
    results = json.loads((run / "results.json").read_text())
    others = set()
    # into their own default folders
    for command in (f"--quick {TOY}", f"--seed 1 {TOY}"):
        train_toy.main(argv(command))
        others |= {p.name for p in (at_root / "runs").iterdir()}
        assert snapshot(run / "checkpoints") == checkpoints
        assert json.loads((run / "results.json").read_text()) == results
    assert {"toy-quick-teacher2-mtp1-eval1", "toy-seed1-teacher2-mtp1-eval1"} <= others


def without_timing(rows):
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def test_the_same_toy_run_again_retrains_nothing(at_root):
    run = at_root / TOY_RUN
    checkpoints = snapshot(run / "checkpoints")
    results = json.loads((run / "results.json").read_text())
    again = train_toy.main(argv(TOY))
    assert snapshot(run / "checkpoints") == checkpoints
    assert without_timing(again["rows"]) == without_timing(results["rows"])


@pytest.fixture
def ft_copy(root, tmp_path, monkeypatch):
    """A copy of the finished finetune_hf run (two steps), its model and data, to run in."""
    for name in ("ft", "base", "wp"):
        shutil.copytree(root / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def logged_steps(run):
    return [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]


def test_resume_compares_paths_by_meaning(ft_copy, capsys):
    # the first run was given relative paths; these are absolute
    model = ft_copy / "base"
    rows = ft_copy / "wp" / "train.json"
    command = f"train --model {model} --data {rows} --out ft --steps 3 {TRAIN} --resume"
    assert finetune_hf.main(argv(command)) == 0
    assert "resumed from" in capsys.readouterr().out
    assert logged_steps(ft_copy / "ft") == [1, 2, 3]


def test_overwrite_replaces_the_run(ft_copy):
    command = f"train --model base --data wp/train.json --out ft --steps 1 {TRAIN} --overwrite"
    assert finetune_hf.main(argv(command)) == 0
    assert logged_steps(ft_copy / "ft") == [1]
    steps = sorted(p.name for p in (ft_copy / "ft" / "checkpoints").glob("step_*"))
    assert steps == ["step_000001"]


def test_warmup_longer_than_the_run_is_announced(at_root, capsys, tmp_path):
    out = tmp_path / "w"
    command = f"{train_with(out=out)} --steps 1 --warmup 2000"
    assert finetune_hf.main(argv(command)) == 0
    printed = capsys.readouterr().out
    warning = "warning: --warmup 2000 is over half of --steps 1"
    assert f"{warning}: the learning rate only reaches 0.05% of --lr" in printed


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
    step = interrupted_at_call(2, finetune_hf.train_step)
    monkeypatch.setattr(finetune_hf, "train_step", step)
    out = tmp_path / "cut"
    assert finetune_hf.main(argv(f"{train_with(out=out)} --steps 3")) == 130
    err = capsys.readouterr().err.strip()
    saved = out / "checkpoints" / "step_000001"
    how = "run the same command with --resume to continue"
    assert err == f"interrupted: the last checkpoint is {saved}; {how}"


def test_ctrl_c_in_the_toy_says_what_is_saved(at_root, capsys, monkeypatch):
    real = train_toy.train_phase

    def interrupted_students(name, *args, **kwargs):
        if name == "naive":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(train_toy, "train_phase", interrupted_students)
    status, err = in_process("train_toy", argv(f"--seed 5 {TOY}"))
    assert status == 130
    run = os.path.join("runs", "toy-seed5-teacher2-mtp1-eval1")
    how = "run the same command again to continue from there"
    assert err.strip() == f"interrupted: {run}/checkpoints holds teacher; {how}"


# ----------------------------------------------------------------------------------------------
# No command writes over what it did not make; interrupted work keeps what it finished
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def exported(at_root, tmp_path):
    """An export of the finished run into a new folder."""
    out = tmp_path / "exp"
    assert finetune_hf.main(argv(f"export --checkpoint ft --out {out}")) == 0
    return out


def test_export_copies_the_base_models_generation_config(at_root, exported):
    copied = (exported / "generation_config.json").read_text()
    assert copied == (at_root / "base" / "generation_config.json").read_text()


def test_export_files_follow_the_umask(exported):
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.stat().st_mode & 0o777 for p in exported.iterdir()}
    # safetensors' files too
    assert modes == {0o666 & ~umask}


def test_export_refuses_its_own_earlier_output_without_overwrite(exported, capsys):
    assert finetune_hf.main(argv(f"export --checkpoint ft --out {exported}")) == 2
    err = capsys.readouterr().err
    assert "holds an earlier export's output: add --overwrite" in err


def test_export_replaces_its_own_earlier_output_with_overwrite(exported):
    command = f"export --checkpoint ft --out {exported} --overwrite"
    assert finetune_hf.main(argv(command)) == 0


def test_export_never_writes_over_a_model_it_did_not_write(at_root, capsys):
    command = "export --checkpoint ft --out base --overwrite"
    assert finetune_hf.main(argv(command)) == 2
    assert "holds a model that export did not write" in capsys.readouterr().err


def test_export_never_writes_over_a_training_run(at_root, capsys):
    command = "export --checkpoint ft --out ft --overwrite"
    assert finetune_hf.main(argv(command)) == 2
    assert "holds a training run" in capsys.readouterr().err


def data_command(rows):
    """Rows from the model for two domains, lists then writing, two rows each."""
    domains = "--domains lists writing --per-domain 2 --max-new-tokens 4"
    return argv(f"data --model base --out {rows} {domains}")


@pytest.fixture
def data_cut_in_writing(at_root, capsys, monkeypatch, tmp_path):
    """`data` interrupted in its second domain: the rows file, and what it wrote to stderr."""
    real = training_rows.generate
    monkeypatch.setattr(training_rows, "generate", interrupted_at_call(2, real))
    rows = tmp_path / "rows.jsonl"
    assert finetune_hf.main(data_command(rows)) == 130
    return rows, capsys.readouterr().err


def test_data_on_ctrl_c_says_what_it_kept(data_cut_in_writing):
    rows, err = data_cut_in_writing
    kept = f"interrupted: {rows} holds the 2 rows of lists"
    assert err.strip() == f"{kept}; writing and the domains after it were not made"


def test_data_on_ctrl_c_keeps_the_finished_domains(data_cut_in_writing):
    rows, _ = data_cut_in_writing
    domains = [json.loads(line)["domain"] for line in rows.read_text().splitlines()]
    assert domains == ["lists", "lists"]


def test_data_never_replaces_a_file_unasked(at_root, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("my notes\n")
    assert finetune_hf.main(data_command(rows)) == 2
    assert rows.read_text() == "my notes\n"


def test_data_replaces_a_file_with_overwrite(at_root, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("my notes\n")
    assert finetune_hf.main([*data_command(rows), "--overwrite"]) == 0
    assert len(rows.read_text().splitlines()) == 4


def eval_command(out):
    """Greedy and static k = 2 over the word problems, zero-shot, four tokens an answer."""
    decoders = "--static-k 1 2 --taus"
    settings = f"--prompt-style zeroshot --max-new-tokens 4 {decoders}"
    return argv(f"eval --model ft/final --data wp/test.jsonl --out {out} {settings}")


@pytest.fixture
def eval_cut_in_its_second_decoder(at_root, capsys, monkeypatch, tmp_path):
    """`eval` interrupted in its second decoder: what it printed, and its folder."""
    real = gsm8k.generate
    monkeypatch.setattr(gsm8k, "generate", interrupted_at_call(2, real))
    out = tmp_path / "ev"
    assert finetune_hf.main(eval_command(out)) == 130
    return capsys.readouterr(), out


def test_eval_prints_the_table_head_before_decoding(eval_cut_in_its_second_decoder):
    printed, _ = eval_cut_in_its_second_decoder
    assert printed.out.splitlines()[1].startswith("| decoding |")


def test_eval_on_ctrl_c_says_what_it_kept(eval_cut_in_its_second_decoder):
    printed, out = eval_cut_in_its_second_decoder
    kept = f"{out} holds the results of the 1 finished decoder(s)"
    # after the line naming the defaults ft/final was trained with
    assert printed.err.strip().splitlines()[-1] == f"interrupted: {kept}"


def test_eval_on_ctrl_c_keeps_the_finished_decoders_results(eval_cut_in_its_second_decoder):
    _, out = eval_cut_in_its_second_decoder
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["decoding"] for r in results] == ["k=1 (greedy)"]


def test_eval_writes_to_runs_gsm8k_eval_by_default():
    command = argv("eval --model ft/final --data wp/test.jsonl")
    parsed = finetune_cli.build_parser().parse_args(command)
    assert parsed.out == os.path.join("runs", "gsm8k_eval")


def test_eval_shows_progress_within_a_decoder(at_root, capsys, tmp_path):
    write_word_problems(tmp_path / "wp", n_train=1, n_test=6, seed=3)
    rows = tmp_path / "wp" / "test.jsonl"
    settings = "--prompt-style zeroshot --max-new-tokens 2 --batch-size 1 --static-k 1 --taus"
    command = f"eval --model ft/final --data {rows} --out {tmp_path / 'ev'} {settings}"
    assert finetune_hf.main(argv(command)) == 0
    # parts of 4 batches of 1
    assert "greedy: 4/6 answers" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Training on nothing is refused; resuming continues the run
# ----------------------------------------------------------------------------------------------

NOTHING_TO_TRAIN_ON = [
    ("--data targetless/empty_responses --response-only", "no training targets"),
    ("--data wp/train.json --response-only --seq-len 8",
     "8 rows are cut by --seq-len 8 before their response starts"),
    ("--data targetless/unfinished", "marked unfinished: nothing to train on"),
]


@pytest.mark.parametrize("rows,cause", NOTHING_TO_TRAIN_ON)
def test_training_on_nothing_is_refused_with_its_cause(at_root, capsys, rows, cause):
    command = f"train --model base --out o {TRAIN} {rows}"
    assert finetune_hf.main(argv(command)) == 2
    assert cause in capsys.readouterr().err


@pytest.fixture
def mixed_rows_run(at_root, capsys, tmp_path):
    """One step on the word problems plus 3 unfinished rows and 3 empty responses: its output."""
    rows = "wp/train.json targetless/unfinished targetless/empty_responses"
    out = tmp_path / "t"
    command = f"train --model base --out {out} {TRAIN} --steps 1 --response-only --data {rows}"
    assert finetune_hf.main(argv(command)) == 0
    return capsys.readouterr().out


def test_unfinished_rows_are_skipped(mixed_rows_run):
    assert "skipped 3 rows marked unfinished" in mixed_rows_run


def test_rows_without_targets_are_announced(mixed_rows_run):
    cut = "0 rows are cut by --seq-len 32 before their response starts"
    warning = f"warning: 3 of 11 rows give no target ({cut} and 3 have an empty response)"
    assert warning in mixed_rows_run


def test_each_checkpoint_is_announced_with_its_size_and_how_many_are_kept(mixed_rows_run):
    assert "GB; the last 2 are kept" in mixed_rows_run


def test_a_full_scale_run_on_a_cpu_says_so_before_its_first_step(at_root, capsys, monkeypatch,
                                                                 tmp_path):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune_hf, "train_step", stop)
    out = tmp_path / "big"
    command = f"train --model base --data wp/train.json --out {out} --micro-batch 2 --seq-len 32"
    assert finetune_hf.main(argv(command)) == 130
    printed = capsys.readouterr().out
    assert "100,000 steps of 128 sequences of 32 tokens" in printed
    scale = "12,800,000 sequences, the scale of the paper's multi-GPU recipe"
    assert f"note: that is {scale}" in printed


def train_seed_1(out, steps, *extra):
    command = f"{train_with(out=out)} --steps {steps} --seed 1"
    return finetune_hf.main([*argv(command), *extra])


@pytest.fixture(scope="module")
def resumed(root, tmp_path_factory):
    """A run of 6 steps straight, one cut at 4 and resumed to 6: their logs, what resuming said."""
    runs = tmp_path_factory.mktemp("resumed")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(root)
        assert train_seed_1(runs / "straight", 6) == 0
        assert train_seed_1(runs / "cut", 4) == 0
        said = len(printed.getvalue())
        assert train_seed_1(runs / "cut", 6, "--resume") == 0
    logs = {}
    for name in ("straight", "cut"):
        lines = (runs / name / "log.jsonl").read_text().splitlines()
        logs[name] = [json.loads(line) for line in lines]
    return SimpleNamespace(runs=runs, logs=logs, said=printed.getvalue()[said:])


def test_resume_to_more_steps_continues_the_schedule(resumed):
    straight = [r["lr"] for r in resumed.logs["straight"]]
    cut = [r["lr"] for r in resumed.logs["cut"]]
    # step 5 is not at rate 0
    assert straight == cut


def test_resume_to_more_steps_ends_where_a_straight_run_ends(resumed):
    straight = resumed.logs["straight"][-1]["loss"]
    cut = resumed.logs["cut"][-1]["loss"]
    assert straight == pytest.approx(cut, rel=1e-5)


def test_resume_to_more_steps_says_the_first_steps_followed_a_shorter_schedule(resumed):
    assert "steps 1-4 followed the schedule of a 4-step run" in resumed.said


def test_resume_to_fewer_steps_is_refused(resumed, at_root, capsys):
    assert train_seed_1(resumed.runs / "cut", 3, "--resume") == 2
    err = capsys.readouterr().err
    assert "has done 6 steps already; resume it with --steps 6 or more" in err


# ----------------------------------------------------------------------------------------------
# The decoding command line speaks the model's prompt format; smaller things
# ----------------------------------------------------------------------------------------------

PROMPT = "Tom has 3 pens."

GREEDY = f"--model ft/final --prompt '{PROMPT}' --greedy"


def prompt_tokens_of(fmt):
    """The prompt's tokens in this format: raw or plain (auto: ft/final's trained_with.json
    says plain, the format it was trained in)."""
    tok = Tokenizer.from_pretrained(Path("ft") / "final")
    if fmt in ("plain", "auto"):
        return prompt_tokens(tok, "plain", PROMPT)
    return [tok.bos_id, *tok.encode(PROMPT)]


@pytest.mark.parametrize("fmt", ["auto", "raw", "plain"])
def test_confadapt_formats_the_prompt_as_asked(at_root, capsys, fmt):
    assert confadapt.main(argv(f"{GREEDY} --max-new-tokens 2 --json --format {fmt}")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["prompt_tokens"] == len(prompt_tokens_of(fmt))


def test_export_records_the_k_max_and_format_it_trained_with(at_root):
    assert json.loads(Path("ft/final/trained_with.json").read_text()) == {"k_max": 4,
                                                                         "format": "plain"}


@pytest.mark.parametrize("flags,k_max,named", [("", 4, "--k-max 4 --format plain"),
                                               ("--k-max 8", 8, "--format plain"),
                                               ("--k-max 8 --format raw", 8, None)])
def test_confadapt_decodes_a_tuned_folder_as_it_was_trained(at_root, capsys, flags, k_max,
                                                            named):
    line = f"--model ft/final --prompt '{PROMPT}' --max-new-tokens 2 --json {flags}"
    assert confadapt.main(argv(line)) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["mode"] == f"confadapt tau=0.9 k_max={k_max}"
    said = [x for x in printed.err.splitlines() if x.startswith("defaults from")]
    if named is None:
        assert said == []
    else:
        assert said == [f"defaults from {os.path.join('ft', 'final', 'trained_with.json')}: "
                        f"{named} (as it was trained; give the flags to override)"]


def test_eval_decodes_a_tuned_folder_at_its_trained_k_max(at_root, tmp_path):
    line = (f"eval --model ft/final --data wp/test.jsonl --out {tmp_path / 'ev'} --static-k "
            "--taus 0.9 --max-new-tokens 2 --prompt-style zeroshot")
    assert finetune_hf.main(argv(line)) == 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert [r["k_max"] for r in results["results"]] == [4]
    assert results["meta"]["format"] == "plain"


def test_confadapt_auto_is_raw_on_a_model_that_records_no_format(at_root, capsys):
    # base/ has no chat tokens and no trained_with.json: the text itself after BOS
    line = f"--model base --prompt '{PROMPT}' --greedy --max-new-tokens 2 --json"
    assert confadapt.main(argv(line)) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["prompt_tokens"] == len(prompt_tokens_of("raw"))


def test_confadapt_makes_the_folder_of_its_png_after_decoding(at_root, tmp_path):
    png = tmp_path / "new" / "folder" / "chunks.png"
    assert confadapt.main(argv(f"{GREEDY} --max-new-tokens 2 --png {png}")) == 0
    height, width = imread(png).shape[:2]
    assert height > 0
    assert width > 0


def test_confadapt_says_when_it_stops_at_the_end_of_the_context(at_root, capsys):
    assert confadapt.main(argv(f"{GREEDY} --max-new-tokens 500")) == 0
    err = capsys.readouterr().err
    assert "stopped at the end of the model's context (64 tokens)" in err


def help_text(command, capsys):
    """What `finetune_hf.py COMMAND --help` prints, its whitespace collapsed."""
    with pytest.raises(SystemExit):
        finetune_cli.build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["eval", "analyze", "data"])
def test_help_says_what_max_new_tokens_does(command, capsys):
    assert "most tokens of each answer" in help_text(command, capsys)


@pytest.mark.parametrize("command", ["eval", "analyze", "data"])
def test_help_says_what_dtype_auto_picks(command, capsys):
    assert "auto (the default): bfloat16" in help_text(command, capsys)


def test_cudnn_attention_off_leaves_cuda_the_memory_efficient_and_math_kernels():
    """The kernel list --cudnn-attention sets, read back from torch.backends.cuda (the switches
    exist, and are read back, without a GPU). On a CPU nothing is switched."""
    switches = [f"{key}_sdp" for key in cli.SDPA_KERNELS.values()]
    before = [getattr(torch.backends.cuda, f"{s}_enabled")() for s in switches]
    try:
        cuda = torch.device("cuda")
        assert cli.apply_attention_backend("off", cuda) == ["memory-efficient", "math"]
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        everything = ["cudnn", "flash", "memory-efficient", "math"]
        assert cli.apply_attention_backend("auto", cuda) == everything
        assert cli.apply_attention_backend("off", torch.device("cpu")) == everything
    finally:
        for switch, on in zip(switches, before):
            getattr(torch.backends.cuda, f"enable_{switch}")(on)


class Applied(Exception):
    """Raised by the stand-in for apply_attention_backend: the command got that far."""


@pytest.mark.parametrize("module, command", [
    (cli, f"confadapt {GREEDY} --cudnn-attention auto"),
    (finetune_cli, f"finetune_hf {train_with()} --cudnn-attention auto"),
    (finetune_cli, "finetune_hf eval --model ft/final --data wp/test.jsonl --cudnn-attention auto"),
    (train_toy, "train_toy --quick --out new --cudnn-attention auto"),
])
def test_commands_that_decode_or_train_apply_cudnn_attention(at_root, monkeypatch, module,
                                                             command):
    """Each applies the flag on its device before any model work."""
    calls = []

    def applied(choice, device):
        calls.append((choice, device.type))
        raise Applied

    monkeypatch.setattr(module, "apply_attention_backend", applied)
    name, *words = argv(command)
    with pytest.raises(Applied):
        MAINS[name](words + ["--device", "cpu"])
    assert calls == [("auto", "cpu")]


def test_the_scripts_that_decode_or_train_take_cudnn_attention():
    """bench_modes (through mtp.cli.load), decode_real and word_problem_base: the flag, its
    default and its choices in --help."""
    scripts = [*SCRIPTS.values(), REPO / "benchmarks" / "decode_real.py"]
    for script in scripts:
        [done] = run_script(script, ["--help"])
        help = " ".join(done.stdout.split())
        assert "--cudnn-attention {auto,off}" in help, script
        assert "off (the default)" in help, script


def analyze(model, out):
    """analyze on two list prompts, four tokens an answer, at tau 0.9 -> the domain's report."""
    settings = "--domains lists --limit 2 --max-new-tokens 4 --taus 0.9"
    assert finetune_hf.main(argv(f"analyze --model {model} {settings} --out {out}")) == 0
    return json.loads((out / "analysis.json").read_text())["domains"]["lists"]


FLOOR = "a floor: tuning sharpens confidences"

WORTH_TUNING = "predictable enough to be worth tuning"


def test_analyze_calls_an_unsure_models_estimate_a_floor(at_root, capsys, tmp_path):
    report = analyze("base", tmp_path / "an")
    # the setup: the random model is sure of none of its tokens at tau 0.9, so ConfAdapt
    # would keep one token a pass
    assert report["estimates"][0]["share_confident"] == 0
    printed = capsys.readouterr().out
    assert FLOOR in printed
    assert WORTH_TUNING not in printed


def test_analyze_calls_a_sure_models_domain_worth_tuning(at_root, capsys, tmp_path):
    write_base_model(tmp_path / "sure", logit_scale=1000)
    report = analyze(tmp_path / "sure", tmp_path / "an")
    # the setup: sure of every token, so ConfAdapt would keep whole answers in one pass
    assert report["estimates"][0]["share_confident"] == 1
    printed = capsys.readouterr().out
    assert WORTH_TUNING in printed
    assert FLOOR not in printed


CUDA = torch.device("cuda")


def test_auto_dtype_is_float32_on_a_cpu_without_bfloat16_instructions(monkeypatch):
    monkeypatch.setattr(cli, "native_bfloat16_cpu", lambda: False)
    assert parse_dtype("auto", torch.device("cpu")) == torch.float32


def test_auto_dtype_is_bfloat16_on_a_cpu_with_avx512_bf16_or_amx(monkeypatch):
    monkeypatch.setattr(cli, "native_bfloat16_cpu", lambda: True)
    assert parse_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_auto_dtype_is_float32_on_a_gpu_that_only_emulates_bfloat16(monkeypatch):
    # a T4 or V100: torch.cuda.is_bf16_supported() says yes by default, counting emulation
    def t4(including_emulation=True):
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", t4)
    assert parse_dtype("auto", CUDA) == torch.float32


def a100(including_emulation=True):
    return True


def test_auto_dtype_is_bfloat16_on_a_gpu_that_computes_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", a100)
    assert parse_dtype("auto", CUDA) == torch.bfloat16


def test_a_dtype_given_is_the_dtype_used(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", a100)
    assert parse_dtype("float32", CUDA) == torch.float32


def test_provenance_names_commit_cpu_dtype_torch_and_threads():
    here = provenance(torch.bfloat16)
    assert set(here) == {"commit", "cpu", "dtype", "torch", "threads"}


def test_provenance_records_this_machine():
    here = provenance(torch.bfloat16)
    assert here["dtype"] == "bfloat16"
    assert here["cpu"]
    assert here["torch"] == torch.__version__
    assert here["threads"] == torch.get_num_threads()


def test_provenance_without_git_has_no_commit(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    # no git: None, and no error
    assert provenance(torch.float32)["commit"] is None


def test_cpu_device_is_the_cpu():
    assert parse_device("cpu") == torch.device("cpu")


def test_auto_device_is_the_cpu_without_a_gpu():
    # conftest: the default suite sees no GPU
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert parse_device("auto") == torch.device("cpu")


BAD_DEVICES = [
    ("cuda:0", "CUDA is not available"),
    ("cuda", "CUDA is not available"),
    ("gpu", "unknown device"),
    ("cuda:x", "unknown device"),
    ("mps", "unknown device"),
]


@pytest.mark.parametrize("name,message", BAD_DEVICES)
def test_a_device_that_cannot_be_used_fails_in_one_line(name, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_device(name)
    assert "\n" not in str(err.value)
