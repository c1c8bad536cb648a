"""benchmarks/decode_real.py end to end on a tiny random Llama in the Hugging Face layout, and the
check that makes its lossless columns worth reading: output that is not greedy's is caught."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import decode_real  # noqa: E402
from bench_modes import bench  # noqa: E402
from confadapt import DecodeConfig  # noqa: E402
from tasks.word_problems import word_problem_tokenizer
from mtp.engine import generate  # noqa: E402
from mtp.hf import from_pretrained  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")            # conftest.py


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random Llama checkpoint without <mask>, as a user's model folder would be before tuning."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_problem_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_benchmark_runs_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert decode_real.main(["--model", tiny_dir, "--out", str(out), "--quick", "--max-new-tokens", "12",
                             "--latency-sizes", "1", "3", "--latency-repeats", "1", "--k-max", "4", "2"]) == 0
    report = json.loads((out / "results.json").read_text())
    rows = {(r["batch_size"], r["mode"]): r for r in report["decoding"]}
    lookup = "transformers prompt lookup n=10"
    # ConfAdapt: every tau at every k_max; lossless at the largest k_max
    assert {m for b, m in rows if b == 1} == {"greedy", "static k=4", "confadapt tau=0.9 k_max=4",
                                               "confadapt tau=0.7 k_max=4", "confadapt tau=0.9 k_max=2",
                                               "confadapt tau=0.7 k_max=2", "lossless k=4",
                                               "transformers greedy", lookup}
    assert max(map(int, rows[1, "confadapt tau=0.7 k_max=2"]["accept_hist"])) <= 2     # tokens per pass
    assert (4, lookup) not in rows and (4, "transformers greedy") in rows        # prompt lookup: batch 1 only
    for bs in (1, 4):
        assert rows[bs, "lossless k=4"]["equals_greedy"] and rows[bs, "transformers greedy"]["equals_greedy"]
        assert rows[bs, "greedy"]["speedup"] == 1.0
        assert rows[bs, "transformers greedy"]["speedup_vs_transformers"] == 1.0
        assert rows[bs, "static k=4"]["effective_k"] == 4.0
    # transformers' greedy, measured from outside, makes one token per row per pass, like ours
    assert rows[1, "transformers greedy"]["effective_k"] == 1.0 == rows[1, "transformers greedy"]["fed_per_token"]
    assert rows[1, lookup]["equals_greedy"] and rows[1, lookup]["effective_k"] >= 1.0
    assert set(report["latency_ms"]) == {"float32", "bfloat16"}
    assert set(report["latency_ms"]["float32"]) == {"1", "16"}
    assert set(report["latency_ms"]["float32"]["16"]) == {"1", "3"}
    md = (out / "results.md").read_text()
    assert "| 1 | lossless k=4 |" in md and "batch 1 only" in md and "| 16 | bfloat16 |" in md
    assert (out / "decoding.png").stat().st_size > 1000 and (out / "latency.png").stat().st_size > 1000
    assert "has no <mask> token" in capsys.readouterr().err
    # tokens per pass by domain: a domain's tokens over its passes (static k = 4: at most 4, less
    # where a row's last pass is cut short by a stop token)
    by_domain = rows[1, "static k=4"]["effective_k_by_domain"]
    assert list(by_domain) == ["math", "code", "explain", "story"] and all(1 <= v <= 4 for v in by_domain.values())
    assert rows[1, "greedy"]["effective_k_by_domain"] == dict.fromkeys(by_domain, 1.0)
    assert "effective_k_by_domain" not in rows[1, "transformers greedy"]        # its passes per row: unseen
    assert "| tokens per pass, batch 1 | math | code | explain | story |" in md
    samples = (out / "samples.md").read_text()
    assert samples.count("## ") == 4 and samples.count("**static k=4** (") == 4 and "|" in samples


def test_equals_greedy_catches_a_wrong_token(tiny_dir, tmp_path, monkeypatch):
    """Output that differs from greedy's in one token is reported as such, in bench and in the table."""
    model = from_pretrained(tiny_dir)

    def corrupted(rows, n, bs):
        gens, stats = generate(model, rows, n, DecodeConfig("greedy"), batch_size=bs)
        gens[-1].tokens[-1] += 1
        return gens, stats

    report = bench(model, [[1, 2, 3], [4, 5, 6, 7]], 6, [DecodeConfig("greedy")], batch_sizes=(1, 2), repeats=1,
                   latency_sizes=(), others={"corrupted greedy": corrupted})
    same = {(r["batch_size"], r["mode"]): r["equals_greedy"] for r in report["results"]}
    assert same == {(1, "greedy"): True, (1, "corrupted greedy"): False,
                    (2, "greedy"): True, (2, "corrupted greedy"): False}

    honest, workloads = decode_real.hf_decode, []

    def wrong_transformers(*args):
        workloads.append(len(args[1]))                                     # the rows it was given
        result = honest(*args)
        if result is not None:
            result[0][0].tokens[0] += 1
        return result

    monkeypatch.setattr(decode_real, "hf_decode", wrong_transformers)
    out = tmp_path / "out"
    assert decode_real.main(["--model", tiny_dir, "--out", str(out), "--quick", "--max-new-tokens", "4",
                             "--parts", "decoding", "--modes", "greedy", "hf-greedy", "hf-lookup", "--rows", "6"]) == 0
    report = json.loads((out / "results.json").read_text())
    rows = report["decoding"]
    assert report["meta"]["rows"] == 6 and 6 in workloads                  # the 4 prompts cycled to 6 rows
    assert [(r["mode"], r["equals_greedy"]) for r in rows if r["batch_size"] == 1] == [
        ("greedy", True), ("transformers greedy", False), ("transformers prompt lookup n=10", False)]
    assert "| 1 | transformers greedy |" in (out / "results.md").read_text()
    assert (out / "results.md").read_text().count("**no**") == 3              # batch 1: both; batch 4: greedy


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "--batch-sizes must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--rows", "0"], "--rows must be at least 1"),
    (["--rows", "3"], "fewer than the 4 prompts"),
    (["--latency-sizes", "0"], "--latency-sizes must be at least 1"),
    (["--taus", "1.5"], "tau"),
    (["--dtype", "float64"], "invalid choice"),
])
def test_bad_input_gives_one_error_line(tiny_dir, tmp_path, capsys, argv, message):
    assert decode_real.main(["--model", tiny_dir, "--out", str(tmp_path / "o"), "--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decode_real.py: error:") and message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda(tiny_dir, tmp_path, capsys):
    assert decode_real.main(["--model", tiny_dir, "--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_missing_model_and_file_as_out(tmp_path, capsys):
    assert decode_real.main(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "nothing" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert decode_real.main(["--model", str(tmp_path), "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_benchmark_reads_a_gated_adapter_and_compares_with_the_untuned_base(tiny_dir, tmp_path):
    """On an adapter folder, transformers decodes the untuned base, and our greedy and lossless
    modes (base + adapter) print exactly its greedy text."""
    from mtp.cli import load_tokenizer
    from adapter import add_mask_adapter, save_mask_adapter
    from model import add_mask_token

    model = from_pretrained(tiny_dir)
    add_mask_token(model, load_tokenizer(tiny_dir))
    add_mask_adapter(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    save_mask_adapter(model, tmp_path / "adapter", tiny_dir)
    out = tmp_path / "out"
    assert decode_real.main(["--model", str(tmp_path / "adapter"), "--out", str(out), "--parts", "decoding",
                             "--modes", "greedy", "hf-greedy", "lossless", "confadapt", "--quick",
                             "--max-new-tokens", "12", "--k-max", "4", "--dtype", "float32",
                             "--reference", tiny_dir]) == 0
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())["decoding"] if r["batch_size"] == 4}
    assert set(rows) >= {"greedy", "transformers greedy", "lossless k=4"}
    assert rows["transformers greedy"]["equals_greedy"] and rows["lossless k=4"]["equals_greedy"]
    assert rows["greedy"]["same_as_reference"] == rows["lossless k=4"]["same_as_reference"] == 1.0
    assert "= reference's greedy" in (out / "results.md").read_text()
