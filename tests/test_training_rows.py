"""mtp/training_rows.py: `finetune_hf.py data` writes a model's own greedy answers as rows, and
`train` reads them beside another rows file. Refusing rows that give nothing to predict is
checked in test_cli.py, with every other bad input."""
import json

import pytest

import finetune_hf
from tasks.word_problems import domain_prompts

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def own_rows(one_thread_for_module, tiny_hf, tmp_path_factory):
    """`data`: the base model's answers to 3 prompts of 2 domains, a JSONL file."""
    rows_file = tmp_path_factory.mktemp("rows") / "own.jsonl"
    argv = ["data", "--model", str(tiny_hf / "base"), "--out", str(rows_file),
            "--domains", "lists", "writing",
            "--per-domain", "3", "--max-new-tokens", "5"]
    assert finetune_hf.main(argv) == 0
    return rows_file


def test_data_writes_the_models_own_answers_as_rows(own_rows):
    rows = jsonl(own_rows)
    assert [r["domain"] for r in rows] == ["lists"] * 3 + ["writing"] * 3
    assert rows[0]["prompt"] in domain_prompts("lists", 3)
    assert all(isinstance(r["response"], str) for r in rows)


def test_train_reads_them_beside_another_file(own_rows, tiny_hf, tmp_path):
    """Two --data files, and the prefix's plain next-token loss added."""
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_hf / "base"),
            "--data", str(own_rows), str(tiny_hf / "wp" / "train.json"),
            "--out", str(out), "--seq-len", "48", "--batch-size", "4", "--micro-batch", "2",
            "--lr", "1e-3", "--warmup", "2", "--k-max", "6", "--dtype", "float32",
            "--steps", "2", "--prefix-ntp-weight", "0.5"]
    assert finetune_hf.main(argv) == 0
    assert json.loads((out / "train_args.json").read_text())["prefix_ntp_weight"] == 0.5
    log = jsonl(out / "log.jsonl")
    assert len(log) == 2
    assert all(r["loss"] == r["loss"] for r in log)
