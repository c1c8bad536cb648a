"""What a folder says about itself, checked before any weights load (mtp/folders.py).

An adapter runs on the base it was trained on and no other (its fingerprint, cheap at any size);
a prompt format the tokenizer lacks is refused naming those it has; one run at a time writes
into a folder, and a killed run never blocks the next; results.json says the dtype and device
its figures were computed in; lossless is labelled exact in float32 only; a JSON or JSONL file
with a byte-order mark or CRLF line ends reads as without; eval names the tau with the most
tokens per pass within an accuracy tolerance, or none.
"""
import copy
import json
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import confadapt
import finetune_hf
from adapter import ADAPTER_CONFIG, add_mask_adapter, save_mask_adapter
from conftest import ONE_LAYER, tiny_model
from model import add_mask_token
from mtp import cli
from mtp.cli import read_rows
from mtp.folders import FolderLock, base_fingerprint, supported_formats
from mtp.hf import read_json, save_pretrained
from mtp.tokenizer import Tokenizer
from tasks.gsm8k import sweet_spot
from tasks.word_problems import word_problem_tokenizer, write_word_problems

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")

BOM = "\ufeff"


def write_model(folder, seed):
    tok = word_problem_tokenizer()
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    model = tiny_model(tok.n_vocab, seed=seed, max_seq_len=256, **ONE_LAYER, **ids)
    save_pretrained(model, folder)
    tok.save_pretrained(folder)
    return model, tok


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """base/ and other/ (same shapes, other weights), adapter/ trained-looking on base/,
    old_adapter/ as written before the fingerprint, wp/ word problems."""
    root = tmp_path_factory.mktemp("folders")
    model, tok = write_model(root / "base", seed=0)
    write_model(root / "other", seed=1)
    tuned = copy.deepcopy(model)
    add_mask_token(tuned, copy.deepcopy(tok))
    add_mask_adapter(tuned, rank=2, alpha=4.0)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if ".adapter.up" in name:
                p.normal_(0, 0.5)
    save_mask_adapter(tuned, root / "adapter", root / "base")
    shutil.copytree(root / "adapter", root / "old_adapter")
    config = read_json(root / "old_adapter" / ADAPTER_CONFIG)
    del config["format_version"], config["base_fingerprint"]
    (root / "old_adapter" / ADAPTER_CONFIG).write_text(json.dumps(config))
    write_word_problems(root / "wp", n_train=4, n_test=3, seed=0)
    return root


def decode(capsys, *words):
    """confadapt.py in this process -> (exit status, its JSON or None, stderr lines)."""
    status = confadapt.main(["--prompt", "Tom has 3 apples.", "--max-new-tokens", "6",
                             "--json", "--dtype", "float32", *map(str, words)])
    printed = capsys.readouterr()
    out = json.loads(printed.out) if status == 0 else None
    return status, out, printed.err.strip().splitlines()


# --- an adapter knows its base ---

def test_an_adapter_records_its_format_version_and_its_bases_fingerprint(root):
    config = read_json(root / "adapter" / ADAPTER_CONFIG)
    assert config["format_version"] == 2
    assert config["base_fingerprint"] == base_fingerprint(root / "base")
    assert base_fingerprint(root / "other") != config["base_fingerprint"]


def test_an_adapter_on_another_base_is_refused_naming_both_paths(root, tmp_path, capsys):
    # the adapter copied with another model where its base should be
    shutil.copytree(root / "adapter", tmp_path / "adapter")
    shutil.copytree(root / "other", tmp_path / "base")
    status, _, err = decode(capsys, "--model", tmp_path / "adapter", "--greedy")
    assert status == 2 and len(err) == 1
    assert err[0].startswith("error: the adapter ")
    assert str(tmp_path / "adapter") in err[0] and str(tmp_path / "base") in err[0]
    # --base to the wrong model is refused as well; to the right one, it runs
    status, _, err = decode(capsys, "--model", tmp_path / "adapter", "--greedy",
                            "--base", root / "other")
    assert status == 2 and "trained on another base" in err[0]
    status, out, _ = decode(capsys, "--model", tmp_path / "adapter", "--lossless",
                            "--base", root / "base")
    assert status == 0
    _, greedy, _ = decode(capsys, "--model", root / "base", "--greedy")
    assert out["tokens"] == greedy["tokens"]


def test_a_missing_base_names_the_adapter_json_and_the_way_to_point_elsewhere(
        root, tmp_path, capsys):
    shutil.copytree(root / "adapter", tmp_path / "moved")
    status, _, err = decode(capsys, "--model", tmp_path / "moved", "--greedy")
    assert status == 2 and len(err) == 1
    assert str(tmp_path / "moved" / ADAPTER_CONFIG) in err[0]
    assert "--base FOLDER" in err[0] and "edit base_model" in err[0]
    # finetune_hf's commands take --base too
    status = finetune_hf.main(["eval", "--model", str(tmp_path / "moved"), "--base",
                               str(root / "base"), "--data", str(root / "wp" / "test.jsonl"),
                               "--out", str(tmp_path / "ev"), "--limit", "1", "--static-k",
                               "1", "--taus", "--max-new-tokens", "2", "--prompt-style",
                               "zeroshot"])
    assert status == 0


def test_an_adapter_written_before_the_fingerprint_loads_with_a_one_line_notice(root, capsys):
    status, out, err = decode(capsys, "--model", root / "old_adapter", "--lossless")
    assert status == 0
    notes = [line for line in err if line.startswith("note:")]
    assert len(notes) == 1 and "records no fingerprint of its base" in notes[0]
    assert str(root / "base") in notes[0]
    _, greedy, _ = decode(capsys, "--model", root / "base", "--greedy")
    assert out["tokens"] == greedy["tokens"]


def test_the_fingerprint_reads_a_sample_of_a_large_file_not_all_of_it(tmp_path):
    """An 8 GiB safetensors file (sparse: no disk used) is fingerprinted in well under a
    second, where hashing all of it would take tens; a byte in a sampled window counts."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    n_bytes = 8 << 30
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_bytes // 4],
                               "data_offsets": [0, n_bytes]}}).encode()
    file = tmp_path / "model.safetensors"
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + n_bytes)
    start = time.perf_counter()
    before = base_fingerprint(tmp_path)
    assert time.perf_counter() - start < 2.0
    with open(file, "r+b") as f:
        f.seek(8 + len(header))
        f.write(b"\x01")
    assert base_fingerprint(tmp_path) != before


# --- the prompt format, before any weights ---

def test_a_format_the_tokenizer_lacks_is_refused_before_any_weights_load(
        root, capsys, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the format was checked")

    monkeypatch.setattr(cli, "from_pretrained", no_weights)
    status, _, err = decode(capsys, "--model", root / "base", "--greedy", "--format", "chatml")
    assert status == 2
    assert err == [f"error: --format chatml: the tokenizer in {root / 'base'} has not its "
                   "special tokens; it supports plain, raw"]
    status = finetune_hf.main(["analyze", "--model", str(root / "base"), "--format",
                               "llama3-chat", "--data", str(root / "wp" / "test.jsonl")])
    assert status == 2
    assert "it supports plain" in capsys.readouterr().err


def test_the_formats_a_tokenizer_supports(root):
    assert supported_formats(Tokenizer.from_pretrained(root / "base")) == ["plain"]


def test_decode_real_checks_the_format_before_any_weights(root, tmp_path):
    from conftest import run_script
    [done] = run_script(REPO / "benchmarks" / "decode_real.py",
                        ["--model", str(root / "base"), "--out", str(tmp_path / "b"),
                         "--format", "chatml", "--quick"])
    assert done.returncode == 2
    assert "--format chatml" in done.stderr and "it supports plain" in done.stderr


def test_decode_real_decodes_at_the_folders_trained_k_max_and_says_so(root, tmp_path):
    from conftest import run_script
    shutil.copytree(root / "adapter", tmp_path / "adapter")
    (tmp_path / "adapter" / "trained_with.json").write_text('{"k_max": 3, "format": "plain"}')

    def line(out, *more):
        return ["--model", str(tmp_path / "adapter"), "--out", str(tmp_path / out), "--quick",
                "--parts", "decoding", "--modes", "greedy", "confadapt", "--batch-sizes", "1",
                "--max-new-tokens", "4", "--dtype", "float32", "--base", str(root / "base"), *more]

    script = REPO / "benchmarks" / "decode_real.py"
    runs = run_script(script, line("b3"), line("b5", "--k-max", "5"))
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert "trained_with.json: --k-max 3 --format plain (as it was trained" in runs[0].stderr
    assert "trained_with.json: --format plain (as it was trained" in runs[1].stderr
    metas = [read_json(tmp_path / out / "results.json")["meta"] for out in ("b3", "b5")]
    assert [m["k_max"] for m in metas] == [[3], [5]]
    assert {m["format"] for m in metas} == {"plain"}


# --- one run per folder ---

HOLD = """
import sys, time
sys.path.insert(0, sys.argv[2])
from mtp.folders import FolderLock
FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(300)
"""


def holder(folder):
    """A process holding `folder`'s lock (started and waited for)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(REPO)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_folder_in_use_refuses_a_second_run_until_its_holder_dies(root, tmp_path, capsys):
    out = tmp_path / "ev"
    command = ["eval", "--model", str(root / "base"), "--prompt-style", "zeroshot",
               "--data", str(root / "wp" / "test.jsonl"),
               "--out", str(out), "--limit", "1", "--static-k", "1", "--taus",
               "--max-new-tokens", "2"]
    p = holder(out)
    try:
        assert finetune_hf.main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --out {out} is in use by another run (a train, eval, data or "
                       "export writing there): wait for it to end, or choose another folder"]
        # data into a file of that folder is refused too
        rows = ["data", "--model", str(root / "base"), "--out", str(out / "rows.jsonl"),
                "--domains", "lists", "--per-domain", "1", "--max-new-tokens", "2"]
        assert finetune_hf.main(rows) == 2
        assert "its folder" in capsys.readouterr().err
    finally:
        # killed: the OS drops its lock
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert finetune_hf.main(command) == 0
    assert (out / "results.json").is_file()


def test_two_trainings_into_one_folder_the_second_is_refused(tiny_hf, tmp_path, capsys):
    out = tmp_path / "run"
    train = ["train", "--model", str(tiny_hf / "base"), "--data", str(tiny_hf / "wp/train.json"),
             "--out", str(out), "--seq-len", "32", "--batch-size", "2", "--micro-batch", "2",
             "--k-max", "4", "--warmup", "1", "--threads", "1"]
    first = subprocess.Popen([sys.executable, str(REPO / "finetune_hf.py"), *train,
                              "--steps", "100000", "--save-every", "100000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "log.jsonl").is_file():
            assert first.poll() is None, first.stderr.read()
            assert time.time() < deadline
            time.sleep(0.5)
        assert finetune_hf.main([*train, "--steps", "1", "--overwrite"]) == 2
        assert "is in use by another run" in capsys.readouterr().err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert finetune_hf.main([*train, "--steps", "1", "--overwrite"]) == 0


def test_under_torchrun_only_rank_0_holds_the_lock(tmp_path, monkeypatch):
    p = holder(tmp_path / "run")
    try:
        monkeypatch.setenv("RANK", "1")
        assert FolderLock(tmp_path / "run").acquire().fd is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ValueError, match="in use"):
            FolderLock(tmp_path / "run").acquire()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)


# --- results.json, lossless, files as people save them, the tolerance ---

@pytest.fixture(scope="module")
def adapter_eval(root, tmp_path_factory):
    """eval of adapter/ in bfloat16 with the lossless mode and a tolerance, on questions
    saved as Notepad saves them (a byte-order mark, CRLF line ends)."""
    out = tmp_path_factory.mktemp("eval") / "ev"
    lines = (root / "wp" / "test.jsonl").read_text().splitlines()
    data = out.parent / "bom_crlf.jsonl"
    data.write_bytes((BOM + "\r\n".join(lines) + "\r\n").encode("utf-8"))
    status = finetune_hf.main(["eval", "--model", str(root / "adapter"), "--data", str(data),
                               "--out", str(out), "--dtype", "bfloat16", "--static-k", "1",
                               "--taus", "0.9", "--lossless-k", "3", "--max-new-tokens", "4",
                               "--prompt-style", "zeroshot", "--tolerance", "100"])
    assert status == 0
    return out, len(lines)


def test_eval_of_an_adapter_in_bfloat16_records_bfloat16_and_the_device(adapter_eval):
    out, _ = adapter_eval
    meta = read_json(out / "results.json")["meta"]
    assert meta["dtype"] == "bfloat16" and meta["device"] == "cpu"


def test_lossless_is_labelled_exact_in_float32_only(adapter_eval, root, capsys):
    out, _ = adapter_eval
    label = "lossless k=3 (exact in float32; up to rounding in bfloat16)"
    assert f"| {label} |" in (out / "results.md").read_text()
    status = confadapt.main(["--model", str(root / "adapter"), "--prompt", "1", "--lossless",
                             "--k-max", "3", "--max-new-tokens", "2", "--color", "never"])
    assert status == 0
    assert f"mode            {label}" in capsys.readouterr().out


def test_a_byte_order_mark_and_crlf_read_as_without(adapter_eval, tmp_path, root):
    out, n = adapter_eval
    assert read_json(out / "results.json")["results"][0]["n"] == n
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes((BOM + "\r\n".join(map(json.dumps, rows)) + "\r\n").encode())
    array = tmp_path / "rows.json"
    array.write_bytes((BOM + json.dumps(rows, indent=1).replace("\n", "\r\n")).encode())
    assert read_rows(jsonl) == rows and read_rows(array) == rows
    # a config and a tokenizer re-saved by Notepad
    shutil.copytree(root / "base", tmp_path / "base")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        file = tmp_path / "base" / name
        text = file.read_text(encoding="utf-8").replace("\n", "\r\n")
        file.write_bytes((BOM + text).encode("utf-8"))
    assert read_json(tmp_path / "base" / "config.json") == read_json(root / "base" / "config.json")
    ours = Tokenizer.from_pretrained(tmp_path / "base")
    theirs = Tokenizer.from_pretrained(root / "base")
    assert ours.encode("Tom has 3 apples.") == theirs.encode("Tom has 3 apples.")
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_id, theirs.eos_id)
    assert base_fingerprint(tmp_path / "base") == base_fingerprint(root / "base")


def test_eval_names_the_sweet_spot_in_its_summary_and_results(adapter_eval):
    out, n = adapter_eval
    spot = read_json(out / "results.json")["sweet_spot"]
    # a drop of at most 100 points holds for any tau
    assert spot["best_tau"] == 0.9 and spot["n"] == n
    assert spot["summary"] in (out / "results.md").read_text()


def rows_and_correct(taus):
    """results rows and per-question correctness for ConfAdapt taus given as
    (tau, tokens per pass, correctness list)."""
    results = [{"decoding": "k=1 (greedy)", "kind": "greedy"}]
    correct = {}
    for tau, k, right in taus:
        name = f"confadapt tau={tau}"
        results.append({"decoding": name, "kind": "confadapt", "tau": tau, "k_max": 16,
                        "effective_k_overall": k})
        correct[name] = right
    return results, correct


def test_the_sweet_spot_is_the_fastest_tau_within_the_tolerance_by_two_standard_errors():
    base = [True] * 50 + [False] * 50
    # tau 0.9 answers as k=1; tau 0.5 loses 10 of the 50: a drop of 10 points, standard
    # error sqrt(0.1 * 0.9 * 100 / 99) / 10 = 3.02 points
    lossy = [False] * 10 + [True] * 40 + [False] * 50
    results, correct = rows_and_correct([(0.9, 2.0, base), (0.5, 3.0, lossy)])
    spot = sweet_spot(results, correct, base, 20, "k=1")
    assert spot["best_tau"] == 0.5 and spot["n"] == 100
    drop = [t for t in spot["taus"] if t["tau"] == 0.5][0]
    assert drop["drop_points"] == pytest.approx(10.0)
    assert drop["stderr_points"] == pytest.approx(3.015, abs=1e-3)
    # 10 + 2 x 3.02 = 16.0 > 15: only tau 0.9 is within
    assert sweet_spot(results, correct, base, 15, "k=1")["best_tau"] == 0.9


def test_a_tolerance_inside_the_noise_names_no_tau():
    base = [True] * 50 + [False] * 50
    # one question lost, another won: no drop, a standard error of 1.4 points
    swapped = [False] + [True] * 49 + [True] + [False] * 49
    results, correct = rows_and_correct([(0.9, 2.0, swapped)])
    spot = sweet_spot(results, correct, base, 1, "k=1")
    assert spot["best_tau"] is None and "none" in spot["summary"]
    assert "N = 100" in spot["summary"]
    assert sweet_spot(results, correct, base, 3, "k=1")["best_tau"] == 0.9


def test_a_runs_final_folder_written_before_trained_with_takes_the_runs_arguments(capsys):
    """tests/fixtures/dbb8fb7's adapter run: final/ has no trained_with.json; the run's
    train_args.json says k_max 4 and the plain format."""
    from mtp.folders import trained_with
    final = REPO / "tests" / "fixtures" / "dbb8fb7" / "adapter_run" / "final"
    found = trained_with(final)
    assert found == {"k_max": 4, "format": "plain",
                     "file": str(final.parent / "train_args.json")}
    assert trained_with(REPO / "tests" / "fixtures" / "dbb8fb7" / "hf_base") == {}


def test_an_adapter_of_a_newer_format_is_refused_in_one_line(root, tmp_path, capsys):
    shutil.copytree(root / "adapter", tmp_path / "adapter")
    shutil.copytree(root / "base", tmp_path / "base")
    file = tmp_path / "adapter" / ADAPTER_CONFIG
    file.write_text(json.dumps(read_json(file) | {"format_version": 3}))
    status, _, err = decode(capsys, "--model", tmp_path / "adapter", "--greedy")
    assert status == 2
    assert err == [f"error: {file}: format_version 3 is newer than this code reads (2): "
                   "update the code"]
