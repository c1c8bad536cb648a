"""The README's Python example runs as written, and decodes what `confadapt.py` prints.

The code block is taken from README.md itself, its folder replaced by a tiny model with <mask>
(and by SmolLM2-135M with an added <mask>, when scripts/get_smollm2.py has made it), and run
in a process of its own, as a user pastes it.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ONE_LAYER, tiny_model
from model import add_mask_token
from mtp.hf import from_pretrained, save_pretrained
from mtp.tokenizer import Tokenizer
from tasks.word_problems import word_problem_tokenizer

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "models" / "smollm2"
# the folder the example names
FOLDER = "runs/walk/run/final"


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert len(blocks) == 1 and FOLDER in blocks[0]
    return blocks[0]


def run_python(code, cwd=REPO) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def check_example_on(folder):
    """The example on `folder` prints the text confadapt.py decodes with the same settings,
    then its tokens per pass."""
    printed = run_python(readme_example().replace(FOLDER, str(folder)))
    text, passes = printed.rstrip("\n").rsplit("\n", 1)
    assert re.fullmatch(r"\d+\.\d\d tokens per pass", passes)
    cli = [sys.executable, "confadapt.py", "--model", str(folder), "--prompt", "What is 12 + 30?",
           "--tau", "0.9", "--k-max", "4", "--max-new-tokens", "64", "--dtype", "float32",
           "--json"]
    done = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    decoded = json.loads(done.stdout)
    # print() puts a space between the text and the line break
    assert text == decoded["text"] + " "
    assert passes.startswith(f"{decoded['effective_k']:.2f}")


def test_the_readme_example_runs_on_a_tiny_model(tmp_path):
    tok = word_problem_tokenizer()
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    model = tiny_model(tok.n_vocab, max_seq_len=256, **ONE_LAYER, **ids)
    add_mask_token(model, tok)
    save_pretrained(model, tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    check_example_on(tmp_path / "tiny")


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                    reason="SmolLM2 not downloaded (scripts/get_smollm2.py)")
def test_the_readme_example_runs_on_smollm2(tmp_path):
    model = from_pretrained(SMOLLM2)
    tok = Tokenizer.from_pretrained(SMOLLM2)
    add_mask_token(model, tok)
    save_pretrained(model, tmp_path / "smollm2")
    tok.save_pretrained(tmp_path / "smollm2")
    check_example_on(tmp_path / "smollm2")
