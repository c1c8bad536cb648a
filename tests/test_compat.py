"""What users made with the code of commit dbb8fb7 still works: their files load to the same
numbers, their runs resume, and every flag of every command is still taken.

tests/fixtures/dbb8fb7/ holds files that code wrote (make_fixtures.py there says how): a toy run
folder, a Hugging Face folder exported with <mask>, a gated mask adapter folder beside its base,
and a finetune_hf training run with its checkpoint; expected.json holds what each gave that
code, help_flags.json the options each command's --help printed. Every load goes through what
users call: mtp.cli.load_model for a folder, train_toy's and finetune_hf's own command lines for
a run to resume or export. Logits are compared in float32 to 1e-5: a load that changes a weight
fails.
"""
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import finetune_hf
import train_toy
from mtp.cli import load_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "dbb8fb7"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
# the fixtures' own bookkeeping, not a user's files
BOOKKEEPING = ("make_fixtures.py", "expected.json", "help_flags.json")

pytestmark = pytest.mark.usefixtures("one_thread")                     # conftest.py


@pytest.fixture
def old_files(tmp_path, monkeypatch):
    """A copy of the fixtures to work in, as the current folder: the runs name their model
    and data by paths relative to it."""
    folder = tmp_path / "dbb8fb7"
    shutil.copytree(FIXTURES, folder, ignore=shutil.ignore_patterns(*BOOKKEEPING))
    monkeypatch.chdir(folder)
    return folder


def summary(logits: torch.Tensor) -> dict:
    """As make_fixtures.py summarizes logits (T, V): per position the argmax, logsumexp, sum
    and the first three values."""
    x = logits.float()
    return {"argmax": x.argmax(-1).tolist(),
            "logsumexp": x.logsumexp(-1).tolist(),
            "sum": x.sum(-1).tolist(),
            "first": x[:, :3].tolist(),
            # not in expected.json: the scale of each sum, for its tolerance (assert_close)
            "magnitude": x.abs().sum(-1).tolist()}


def logits_of(model, ids) -> dict:
    with torch.no_grad():
        return summary(model(torch.tensor([ids]))[0])


def assert_close(got, want, where="", tol=1e-5):
    """Equal, floats to `tol` (absolute or relative); names the first place that differs."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() - {"magnitude"} == want.keys(), where
        for key in want:
            if key == "sum" and "magnitude" in got:
                # A sum of V logits of both signs. On another processor's float32 kernels
                # the last hidden state rounds differently, and the output matrix moves
                # every logit by it at once: the sum moves by about `tol` of its terms'
                # magnitudes (1.5e-5 seen on an AMD EPYC), far more than `tol` of a sum that
                # cancels. Compared to 10 x `tol` of the magnitudes.
                for i, (g, w, m) in enumerate(zip(got["sum"], want["sum"], got["magnitude"])):
                    assert abs(g - w) <= 10 * tol * m, f"{where}.sum[{i}]: {g} != {w}"
                continue
            assert_close(got[key], want[key], f"{where}.{key}", tol)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]", tol)
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=tol, abs_tol=tol), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def digests(folder: Path) -> dict:
    """{file name: sha256} of the files in `folder`."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- train_toy.py: a run folder resumes -------------------------------------------------

def test_toy_run_folder_resumes_every_phase_without_training(old_files, monkeypatch):
    """`train_toy.py --quick ...` on the old run folder loads all three phases, trains
    nothing (the checkpoints keep their bytes), and evaluates to the same rows and decoded
    samples; --export-hf then writes folders whose logits are the checkpoints'."""
    toy = EXPECTED["toy"]
    # the fixture's --quick preset: the settings in its run_config.json (JSON lists: tuples)
    preset = {k: tuple(v) if isinstance(v, list) else v for k, v in toy["preset"].items()}
    monkeypatch.setattr(train_toy, "QUICK", preset)
    checkpoints = old_files / "toy_run" / "checkpoints"
    before = digests(checkpoints)

    results = train_toy.main([*toy["argv"], "--out", "toy_run"])
    # a phase trained again would be saved again
    assert digests(checkpoints) == before, "a phase was trained again"
    rows = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in results["rows"]]
    assert_close(rows, toy["rows"], "rows")
    assert results["samples"] == toy["samples"]

    assert train_toy.main([*toy["argv"], "--out", "toy_run", "--export-hf", "hf"])["models"]
    for phase, want in toy["logits"].items():
        model, tokenizer, mask_id, _ = load_model(old_files / "hf" / phase)
        ids = toy["input"] if phase == "teacher" else toy["student_input"]
        assert (mask_id is None) == (phase == "teacher")
        assert_close(logits_of(model, ids), want, phase)


# --- Hugging Face folders: exported, and a gated mask adapter beside its base ------------

def test_exported_folder_loads_with_its_mask_token_tokenizer_and_weights(old_files):
    want = EXPECTED["hf_export"]
    model, tokenizer, mask_id, stop_ids = load_model(old_files / want["folder"])
    assert model.config.vocab_size == want["vocab_size"]
    assert mask_id == model.config.mask_token_id == tokenizer.mask_id == want["mask_id"]
    assert sorted(stop_ids) == want["stop_ids"]
    assert [tokenizer.bos_id, *tokenizer.encode(want["text"] + "\n\n")] == want["ids"]
    assert_close(logits_of(model, want["input"]), want["logits"], "logits")


def test_adapter_folder_loads_onto_the_base_it_names(old_files, monkeypatch, capsys):
    """The adapter's folder names its base by a path relative to itself: loaded from another
    folder, it gives its trained mask rows, and at every other position the base model. It
    records no fingerprint of its base (format_version 1): one line says so."""
    want = EXPECTED["adapter"]
    monkeypatch.chdir(old_files.parent)
    model, tokenizer, mask_id, _ = load_model(old_files / want["folder"])
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and notice[0].startswith("note: ")
    assert "records no fingerprint of its base" in notice[0]
    assert mask_id == model.config.mask_token_id == tokenizer.mask_id == want["mask_id"]
    got = logits_of(model, want["input"])
    assert_close(got, want["logits"], "logits")

    base = load_model(old_files / want["base"])[0]
    n = len(want["base_logits"]["argmax"])
    assert want["input"][n:] == [mask_id] * (len(want["input"]) - n)
    with torch.no_grad():
        ours = model(torch.tensor([want["input"][:n]]))[0, :, :mask_id]
        theirs = base(torch.tensor([want["input"][:n]]))[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert_close(summary(theirs), want["base_logits"], "base logits")


# --- finetune_hf.py: a training checkpoint resumes and exports ---------------------------

def test_training_checkpoint_resumes_where_it_stopped(old_files):
    """`train --resume` with more steps starts after the old checkpoint's step 2 and takes
    steps 3 and 4 as the old code did: the same losses, the same final weights."""
    want = EXPECTED["resume"]
    log = old_files / "hf_run" / "log.jsonl"
    before = log.read_text().splitlines()
    argv = [*want["argv"], "--steps", str(want["steps"]), "--resume"]
    assert finetune_hf.main(argv) == 0

    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert log.read_text().splitlines()[:len(before)] == before
    assert_close(rows[len(before):], want["log"], "log")
    model = load_model(old_files / "hf_run" / "final")[0]
    assert_close(logits_of(model, EXPECTED["hf_export"]["input"]), want["logits"], "logits")


def test_training_checkpoint_exports_the_folder_it_was_exported_to(old_files):
    """`export` of the old checkpoint writes the weights the old run exported."""
    assert finetune_hf.main(["export", "--checkpoint", "hf_run", "--out", "exported"]) == 0
    old = load_file(old_files / "hf_run" / "final" / "model.safetensors")
    new = load_file(old_files / "exported" / "model.safetensors")
    assert old.keys() == new.keys()
    for name in old:
        assert torch.equal(old[name], new[name]), name
    want = EXPECTED["hf_export"]
    model = load_model(old_files / "exported")[0]
    assert_close(logits_of(model, want["input"]), want["logits"], "logits")


# --- every flag of every command ---------------------------------------------------------

# Runs each command's --help as `python FILE [SUBCOMMAND] --help` would, all in one process:
# argv[1] is a JSON list of [file, subcommand or null]; prints {command: [exit status, text]}.
HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
# as for `python FILE`: the file's folder on the path, not the current one
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
texts = {}
for file, sub in json.loads(sys.argv[1]):
    sys.argv = [file, *([sub] if sub else []), "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
    out = io.StringIO()
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(file, run_name="__main__")
    except SystemExit as e:
        status = e.code
    except BaseException as e:
        status = repr(e)
    sys.path.pop(0)
    texts[" ".join([file, *([sub] if sub else [])])] = [status, out.getvalue()]
print(json.dumps(texts))
"""


def option_strings(help_text: str) -> set:
    """As make_fixtures.py reads them: the --options its option lines (two spaces, then "-")
    start with, never flags a description mentions."""
    flags = set()
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags |= set(re.findall(r"(?<![\w-])--[\w-]+", invocation))
    return flags


def test_every_command_takes_every_flag_it_took():
    recorded = json.loads((FIXTURES / "help_flags.json").read_text())
    # "finetune_hf.py train" -> [file, subcommand]; "train_toy.py" -> [file, None]
    commands = [(name.split(" ") + [None])[:2] for name in recorded]
    run = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(commands)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    texts = json.loads(run.stdout.splitlines()[-1])
    missing = []
    for name, flags in recorded.items():
        status, text = texts[name]
        gone = sorted(set(flags) - option_strings(text))
        missing += [f"{name}: {flag}" for flag in gone]
        if gone and status not in (0, None):
            missing.append(f"{name}: --help exits {status}: {text[-300:]}")
    assert not missing, "flags no longer taken:\n" + "\n".join(missing)
