"""Shared test setup: the top-level modules on the path, the CPU by default, one tiny model, and
the scripts run as a user runs them.

Two suites that never mix. By default every test runs on the CPU: CUDA is hidden before torch
starts (from the subprocesses the tests start, too), so no test can follow `auto` onto a GPU the
machine happens to have; there the tests marked `gpu` meet attention outputs laid out as CUDA's
memory-efficient kernel lays them out (`cuda_attention_layout`). With MTP_GPU_TESTS=1 only the
tests marked `gpu` run, on CUDA (their `device` fixture), in the dtype each names:

    MTP_GPU_TESTS=1 python -m pytest -q tests

Every test file may build its model with `tiny_model` (`from conftest import tiny_model`):
the same random weights for the same seed, small enough for hundreds of forwards a second.
No test imports a script (benchmarks/, scripts/): `run_script` runs its command lines as
`python SCRIPT ARGS` would, in a process of its own.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

GPU = os.environ.get("MTP_GPU_TESTS") == "1"
if not GPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(min(2, torch.get_num_threads()))

from model import ModelConfig, Transformer  # noqa: E402

# The tests' model: two layers of width 32, four query heads sharing two key/value heads.
TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 64}

# Smaller still, for tests that save models and run whole commands on them.
ONE_LAYER = {"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 32}


def tiny_model(vocab_size: int = 50, seed: int = 0, **fields) -> Transformer:
    """A random Transformer of the TINY sizes, with the same weights for the same seed.

    Keyword arguments set any other ModelConfig field: ONE_LAYER's sizes, bos_token_id, ..."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab_size, **{**TINY, **fields})
    return Transformer(config)


def pytest_configure(config):
    gpu = "gpu: also part of the opt-in GPU suite (MTP_GPU_TESTS=1), run there on CUDA"
    config.addinivalue_line("markers", gpu)
    if GPU and not torch.cuda.is_available():
        raise pytest.UsageError("MTP_GPU_TESTS=1, but torch sees no CUDA GPU")


def pytest_collection_modifyitems(config, items):
    if GPU:
        reason = "the GPU suite (MTP_GPU_TESTS=1) runs only the tests marked gpu"
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "gpu" not in item.keywords:
                item.add_marker(skip)
        return
    # On the CPU the gpu-marked tests meet attention outputs laid out as a GPU kernel lays them out.
    for item in items:
        if "gpu" in item.keywords:
            item.fixturenames.append("cuda_attention_layout")


@pytest.fixture
def device():
    """Where a `gpu`-marked test runs: the CPU by default, CUDA in the GPU suite."""
    return torch.device("cuda" if GPU else "cpu")


@pytest.fixture
def cuda_attention_layout(monkeypatch):
    """Attention outputs laid out in memory as CUDA's memory-efficient kernel returns them.

    That kernel allocates its output as (B, T, H, hd) and returns it transposed to (B, H, T, hd):
    the right values with other strides, so a `.view` that works on the CPU can fail on a GPU.
    Here every scaled_dot_product_attention call returns that layout, on any device."""
    sdpa = F.scaled_dot_product_attention

    def transposed_in_memory(*args, **kwargs):
        y = sdpa(*args, **kwargs)                                 # (B, H, T, hd), contiguous
        return y.transpose(1, 2).contiguous().transpose(1, 2)     # the same, laid out (B, T, H, hd)
    monkeypatch.setattr(F, "scaled_dot_product_attention", transposed_in_memory)


@pytest.fixture
def one_thread():
    """Tiny matmuls are as fast on one thread, and much faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_for_module():
    """one_thread for module-scoped fixtures, which are set up before any function-scoped one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """A tiny Llama checkpoint in Hugging Face layout, written by transformers itself
    (LlamaForCausalLM.save_pretrained) with the word-problem tokenizer beside it, as a downloaded
    checkpoint looks: base/, and word-problem data: wp/train.json, wp/test.jsonl. For
    finetune_hf.py's commands; tests read it and never change it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.word_problems import word_problem_tokenizer, write_word_problems

    root = tmp_path_factory.mktemp("tiny_hf")
    tok = word_problem_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.n_vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    write_word_problems(root / "wp", n_train=64, n_test=6, seed=1)
    return root


# `python -c SCRIPT_RUNNER SCRIPT LINES` runs each command line of LINES (a JSON list of argument
# lists) as `python SCRIPT ARGS` runs it, one after the other in this one process: the modules a
# script imports (torch: seconds) are imported for the first line only. It prints, last, a JSON
# list of [exit status, stdout, stderr] per line. A warning shows in every line that raises it,
# as in a process of its own.
SCRIPT_RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback, warnings
script, lines = sys.argv[1], json.loads(sys.argv[2])
# as for `python SCRIPT`: the script's folder first on the path, not the current one
sys.path[0] = os.path.dirname(os.path.abspath(script))
results = []
for argv in lines:
    sys.argv = [script, *argv]
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        with contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                status = 1
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_script(script, *lines, cwd=None, prelude=""):
    """Each command line (a list of arguments) of `script` run as `python SCRIPT ARGS` runs it,
    one after the other in one process of its own (SCRIPT_RUNNER), after the Python code
    `prelude` -> a SimpleNamespace(returncode, stdout, stderr) per line."""
    command = [sys.executable, "-c", prelude + SCRIPT_RUNNER, str(script), json.dumps(lines)]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return [SimpleNamespace(returncode=s, stdout=out, stderr=err) for s, out, err in results]
