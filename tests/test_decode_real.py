"""benchmarks/decode_real.py end to end on a tiny random Llama in the Hugging Face layout, and the
check that makes its lossless columns worth reading: output that is not greedy's is caught. The
benchmark runs as a user runs it (conftest.run_script)."""
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from adapter import add_mask_adapter, save_mask_adapter
from conftest import run_script
from model import add_mask_token
from mtp.cli import load_tokenizer
from mtp.hf import from_pretrained
from mtp.tokenizer import prompt_tokens
from tasks.word_problems import word_problem_tokenizer, write_word_problems

pytestmark = pytest.mark.usefixtures("one_thread")            # conftest.py

DECODE_REAL = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_real.py"

# A prelude for run_script: transformers' generate made to get one token wrong. In the rows of
# the fourth prompt it is given (the last of the benchmark's four, one row of the six that
# --rows 6 cycles them to), the last token a row keeps (up to its first stop token) is off by
# one. Each call's row count goes to stderr as "generate: N rows".
WRONG_TRANSFORMERS = r"""
import sys
from transformers import GenerationMixin

honest = GenerationMixin.generate
prompts = []                              # each prompt generate is given, once, in order


def generate(self, input_ids, attention_mask, **kwargs):
    out = honest(self, input_ids, attention_mask=attention_mask, **kwargs)
    T = input_ids.shape[1]
    print(f"generate: {len(input_ids)} rows", file=sys.stderr)
    for row, (ids, keep) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
        prompt = [t for t, k in zip(ids, keep) if k]                  # padding left out
        if prompt not in prompts:
            prompts.append(prompt)
        if prompts.index(prompt) == 3:
            new = out[row, T:].tolist()
            stop = [i for i, t in enumerate(new) if t in kwargs["eos_token_id"]]
            out[row, T + (stop[0] if stop else len(new) - 1)] += 1
    return out


GenerationMixin.generate = generate
"""


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


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir, tmp_path_factory):
    """A gated mask adapter on the tiny model, its weights drawn at random, in its own folder."""
    model = from_pretrained(tiny_dir)
    add_mask_token(model, load_tokenizer(tiny_dir))
    add_mask_adapter(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("adapter")
    save_mask_adapter(model, path, tiny_dir)
    return str(path)


# Bad input: (what a test adds to a command line that would run, what its one error line says)
BAD_INPUT = [
    ("--batch-sizes 0", "--batch-sizes must be at least 1"),
    ("--repeats 0", "--repeats must be at least 1"),
    ("--rows 0", "--rows must be at least 1"),
    ("--rows 3", "fewer than the 4 prompts"),
    ("--latency-sizes 0", "--latency-sizes must be at least 1"),
    ("--taus 1.5", "tau"),
    ("--dtype float64", "invalid choice"),
    ("--prompts poems", "invalid choice"),
]


@pytest.fixture(scope="module")
def runs(tiny_dir, adapter_dir, tmp_path_factory):
    """Every run of the benchmark the tests below check, by name: (its --out folder, the finished
    run). They run one after the other in one process (conftest.run_script: torch and
    transformers are imported once), the run with a wrong transformers in a second one beside
    it."""
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "file").write_text("x")
    quick = ["--model", tiny_dir, "--quick"]
    one_thread = ["--threads", "1"]
    # name: (its --out, the rest of its command line)
    honest = {
        "end to end": (tmp / "end_to_end",
                       [*quick, "--max-new-tokens", "12", "--latency-sizes", "1", "3",
                        "--latency-repeats", "1", "--k-max", "4", "2", *one_thread]),
        "adapter": (tmp / "adapter",
                    ["--model", adapter_dir, "--parts", "decoding",
                     "--modes", "greedy", "hf-greedy", "lossless", "confadapt",
                     "--quick", "--max-new-tokens", "12", "--k-max", "4", "--dtype", "float32",
                     "--reference", tiny_dir, *one_thread]),
        "word problems": (tmp / "word_problems",
                          ["--model", adapter_dir, "--prompts", "word_problems",
                           "--parts", "decoding", "--modes", "greedy", "hf-greedy", "hf-lookup",
                           "lossless", "confadapt", "--quick", "--max-new-tokens", "12",
                           "--k-max", "4", "--dtype", "float32", "--reference", tiny_dir,
                           *one_thread]),
        **{extra: (tmp / "o", [*quick, *extra.split()]) for extra, _ in BAD_INPUT},
        "missing model": (tmp / "o", ["--model", str(tmp / "nothing")]),
        "file as out": (tmp / "file", ["--model", str(tmp)]),
    }
    if not torch.cuda.is_available():
        honest["cuda"] = (tmp / "o", ["--model", tiny_dir, "--device", "cuda"])
    wrong = tmp / "wrong_token"
    wrong_argv = ["--out", str(wrong), *quick, "--max-new-tokens", "4", "--parts", "decoding",
                  "--modes", "greedy", "hf-greedy", "hf-lookup", "--rows", "6", *one_thread]
    with ThreadPoolExecutor(1) as beside:
        wrong_run = beside.submit(run_script, DECODE_REAL, wrong_argv, prelude=WRONG_TRANSFORMERS)
        lines = [["--out", str(out), *argv] for out, argv in honest.values()]
        done = run_script(DECODE_REAL, *lines)
    runs = {name: (out, run) for (name, (out, _)), run in zip(honest.items(), done)}
    runs["wrong token"] = (wrong, wrong_run.result()[0])
    return runs


def test_benchmark_runs_end_to_end(runs):
    out, done = runs["end to end"]
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["prompts"] == "chat"                           # the default set
    rows = {(r["batch_size"], r["mode"]): r for r in report["decoding"]}
    lookup = "transformers prompt lookup n=10"
    # ConfAdapt: every tau at every k_max; lossless at the largest k_max
    assert {m for b, m in rows if b == 1} == {"greedy", "static k=4", "confadapt tau=0.9 k_max=4",
                                               "confadapt tau=0.7 k_max=4", "confadapt tau=0.9 k_max=2",
                                               "confadapt tau=0.7 k_max=2", "lossless k=4",
                                               "lossless k=4 + lookup", "transformers greedy", lookup}
    assert max(map(int, rows[1, "confadapt tau=0.7 k_max=2"]["accept_hist"])) <= 2     # tokens per pass
    assert (4, lookup) not in rows and (4, "transformers greedy") in rows        # prompt lookup: batch 1 only
    for bs in (1, 4):
        assert rows[bs, "lossless k=4"]["equals_greedy"] and rows[bs, "transformers greedy"]["equals_greedy"]
        assert rows[bs, "lossless k=4 + lookup"]["equals_greedy"]
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
    assert "| 1 | lossless k=4 (exact in float32; up to rounding in bfloat16) |" in md
    assert "batch 1 only" in md and "| 16 | bfloat16 |" in md
    assert (out / "decoding.png").stat().st_size > 1000 and (out / "latency.png").stat().st_size > 1000
    assert "has no <mask> token" in done.stderr
    # tokens per pass by domain: a domain's tokens over its passes (static k = 4: at most 4, less
    # where a row's last pass is cut short by a stop token)
    by_domain = rows[1, "static k=4"]["effective_k_by_domain"]
    assert list(by_domain) == ["math", "code", "explain", "story"] and all(1 <= v <= 4 for v in by_domain.values())
    assert rows[1, "greedy"]["effective_k_by_domain"] == dict.fromkeys(by_domain, 1.0)
    assert "effective_k_by_domain" not in rows[1, "transformers greedy"]        # its passes per row: unseen
    assert "| tokens per pass, batch 1 | math | code | explain | story |" in md
    samples = (out / "samples.md").read_text()
    assert samples.count("## ") == 4 and samples.count("**static k=4** (") == 4 and "|" in samples


def test_equals_greedy_catches_a_wrong_token(runs):
    """Output that differs from greedy's in one token, the last of one row, is reported as such at
    every batch size, in results.json and in the table."""
    out, done = runs["wrong token"]
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "results.json").read_text())
    rows = report["decoding"]
    calls = [int(line.split()[1]) for line in done.stderr.splitlines()
             if line.startswith("generate: ")]
    # the 4 prompts cycled to 6 rows reach transformers: at batch 4, four rows, then two
    assert report["meta"]["rows"] == 6 and calls[-2:] == [4, 2]
    assert [(r["mode"], r["equals_greedy"]) for r in rows if r["batch_size"] == 1] == [
        ("greedy", True), ("transformers greedy", False), ("transformers prompt lookup n=10", False)]
    assert [(r["mode"], r["equals_greedy"]) for r in rows if r["batch_size"] == 4] == [
        ("greedy", True), ("transformers greedy", False)]
    assert "| 1 | transformers greedy |" in (out / "results.md").read_text()
    assert (out / "results.md").read_text().count("**no**") == 3              # batch 1: both; batch 4: greedy


@pytest.mark.parametrize("extra, message", BAD_INPUT)
def test_bad_input_gives_one_error_line(runs, extra, message):
    _, done = runs[extra]
    assert done.returncode == 2
    err = done.stderr
    assert err.startswith("decode_real.py: error:") and message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda(runs):
    _, done = runs["cuda"]
    assert done.returncode == 2
    assert "CUDA is not available" in done.stderr


def test_missing_model_and_file_as_out(runs):
    _, done = runs["missing model"]
    assert done.returncode == 2
    assert "nothing" in done.stderr
    _, done = runs["file as out"]
    assert done.returncode == 2
    assert "is a file" in done.stderr


def test_benchmark_reads_a_gated_adapter_and_compares_with_the_untuned_base(runs):
    """On an adapter folder, transformers decodes the untuned base, and our greedy and lossless
    modes (base + adapter) print exactly its greedy text."""
    out, done = runs["adapter"]
    assert done.returncode == 0, done.stderr
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())["decoding"] if r["batch_size"] == 4}
    assert set(rows) >= {"greedy", "transformers greedy", "lossless k=4"}
    assert rows["transformers greedy"]["equals_greedy"] and rows["lossless k=4"]["equals_greedy"]
    assert rows["greedy"]["same_as_reference"] == rows["lossless k=4"]["same_as_reference"] == 1.0
    assert "= reference's greedy" in (out / "results.md").read_text()


def test_word_problem_prompts_are_evals_zero_shot_prompts_and_every_decoder_runs_on_them(
        runs, tiny_dir):
    """--prompts word_problems: the held-out questions finetune_hf.py eval reads, in its zero-shot
    prompts (one domain, as many as the chat set's four), decoded by every decoder; lossless and
    transformers' decoders print greedy's tokens, and tokens per pass print for the one domain."""
    out, done = runs["word problems"]
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "results.json").read_text())
    meta = report["meta"]
    _, test_file = write_word_problems(out / "data", n_train=20000, n_test=500)
    questions = [json.loads(line)["question"] for line in test_file.read_text().splitlines()[:4]]
    assert meta["prompts"] == "word_problems"
    assert meta["requests"] == [["word_problems", q] for q in questions]
    tok = load_tokenizer(tiny_dir)
    assert meta["prompt_tokens"] == [len(prompt_tokens(tok, meta["format"], q)) for q in questions]
    rows = {(r["batch_size"], r["mode"]): r for r in report["decoding"]}
    lookup = "transformers prompt lookup n=10"
    assert {m for b, m in rows if b == 1} == {
        "greedy", "transformers greedy", lookup, "lossless k=4", "confadapt tau=0.9 k_max=4",
        "confadapt tau=0.7 k_max=4"}
    for bs in (1, 4):
        assert rows[bs, "lossless k=4"]["equals_greedy"]
        assert rows[bs, "transformers greedy"]["equals_greedy"]
        assert rows[bs, "lossless k=4"]["same_as_reference"] == 1.0
        assert list(rows[bs, "lossless k=4"]["effective_k_by_domain"]) == ["word_problems"]
    assert rows[1, lookup]["equals_greedy"]
    md = (out / "results.md").read_text()
    assert "word-problems prompts" in md and "| tokens per pass, batch 1 | word_problems |" in md
    samples = (out / "samples.md").read_text()
    assert samples.count("## word_problems: ") == 4 and questions[0] in samples


# ----------------------------------------------------------------------------------------------
# benchmarks/adapter_pass.py: one cached pass's cost with the adapter against the base's
# ----------------------------------------------------------------------------------------------

ADAPTER_PASS = DECODE_REAL.parent / "adapter_pass.py"

# A prelude for run_script: every call of Transformer.embed (one per forward pass) noted on
# stderr as "embed: ADAPTER_ON MASKS POSITIONS", so a test sees which passes ran in which order.
NOTE_PASSES = r"""
import sys
sys.path.insert(0, {repo!r})
import model

honest_embed = model.Transformer.embed


def embed(self, tokens, *args, **kwargs):
    on = kwargs.get("use_adapter", args[0] if args else True) and self.mask_embedding is not None
    masks = int((tokens == self.config.mask_token_id).sum())
    print(f"embed: {{int(on)}} {{masks}} {{tokens.numel()}}", file=sys.stderr)
    return honest_embed(self, tokens, *args, **kwargs)


model.Transformer.embed = embed
""".format(repo=str(DECODE_REAL.parents[1]))


# A prelude for run_script: each adapter folder adapter.save_mask_adapter writes is copied to
# the folder KEEP as well (adapter_pass.py writes its fresh adapter to a temporary folder).
KEEP_FRESH = r"""
import shutil
import adapter

honest_save = adapter.save_mask_adapter


def save_mask_adapter(model, path, *args, **kwargs):
    honest_save(model, path, *args, **kwargs)
    shutil.copytree(path, {keep!r})


adapter.save_mask_adapter = save_mask_adapter
"""


@pytest.fixture(scope="module")
def pass_runs(tiny_dir, adapter_dir, tmp_path_factory):
    """adapter_pass.py's runs by name: (its --out, the finished run); the fresh adapter the run
    "fresh" times is kept in its --out's parent, as fresh_adapter."""
    tmp = tmp_path_factory.mktemp("pass_runs")
    (tmp / "taken").mkdir()
    (tmp / "taken" / "adapter_pass.json").write_text("{}")
    fast = ["--repeats", "3", "--context", "10", "--threads", "1", "--dtype", "float32"]
    named = {
        "trained": (tmp / "trained", ["--model", adapter_dir, *fast]),
        "fresh": (tmp / "fresh", ["--model", tiny_dir, "--rank", "3",
                                  "--targets", "wq", "wk", "wv", "wo", "--k-max", "3", *fast]),
        "rank on an adapter": (tmp / "o", ["--model", adapter_dir, "--rank", "3"]),
        "base without rank": (tmp / "o", ["--model", tiny_dir]),
        "targets without rank": (tmp / "o", ["--model", adapter_dir, "--targets", "wq"]),
        "k_max 1": (tmp / "o", ["--model", adapter_dir, "--k-max", "1"]),
        "earlier output": (tmp / "taken", ["--model", adapter_dir, *fast]),
    }
    lines = [["--out", str(out), *argv] for out, argv in named.values()]
    keep = KEEP_FRESH.format(keep=str(tmp / "fresh_adapter"))
    done = run_script(ADAPTER_PASS, *lines, prelude=NOTE_PASSES + keep)
    return {name: (out, run) for (name, (out, _)), run in zip(named.items(), done)}


def passes_seen(stderr: str) -> list[tuple[int, int, int]]:
    """(adapter on, masks, positions) of each forward pass, in order."""
    return [tuple(map(int, line.split()[1:])) for line in stderr.splitlines()
            if line.startswith("embed: ")]


def test_adapter_pass_times_the_three_passes_in_turns(pass_runs):
    """A trained adapter's folder: after the prefill, rounds of (base, 1 token), (base, 4 tokens),
    (adapter, 1 token + 3 masks), one untimed round first; the medians and ratios written are
    those of the passes timed."""
    out, done = pass_runs["trained"]
    assert done.returncode == 0, done.stderr
    seen = passes_seen(done.stderr)
    # the prefill: the base over 10 cached tokens, no mask
    assert seen[0] == (0, 0, 10)
    assert seen[1:] == [(0, 0, 1), (0, 0, 4), (1, 3, 4)] * 4
    report = json.loads((out / "adapter_pass.json").read_text())
    one, four, adapter = "base, 1 token", "base, 4 tokens", "adapter, 1 token + 3 masks"
    assert list(report["ms"]) == [one, four, adapter]
    for name, seconds in report["seconds"].items():
        assert len(seconds) == 3 and report["ms"][name] == pytest.approx(1e3 * sorted(seconds)[1])
    ratio = report["ms"][adapter] / report["ms"][one]
    assert report["ratios"][f"{adapter} / {one}"] == pytest.approx(ratio)
    paired = sorted(a / b for a, b in zip(report["seconds"][adapter], report["seconds"][one]))[1]
    assert report["paired_ratios"][f"{adapter} / {one}"] == pytest.approx(paired)
    meta = report["meta"]
    assert meta["adapter"]["rank"] == 2 and not meta["adapter"]["fresh"]
    assert meta["dtype"] == "float32" and meta["threads"] == 1 and meta["machine"]
    md = (out / "adapter_pass.md").read_text()
    assert f"| {adapter} / {one} |" in md and "a trained gated mask adapter" in md
    assert md in done.stdout


def test_adapter_pass_builds_a_fresh_adapter_of_the_rank_and_targets_asked(pass_runs, tiny_dir):
    """--rank 3 --targets wq wk wv wo on the base folder: the adapter timed has that rank on those
    projections (its parameter count says so), and its pass is 1 token + k_max - 1 masks."""
    out, done = pass_runs["fresh"]
    assert done.returncode == 0, done.stderr
    assert passes_seen(done.stderr)[1:] == [(0, 0, 1), (0, 0, 3), (1, 2, 3)] * 4
    meta = json.loads((out / "adapter_pass.json").read_text())["meta"]
    assert meta["adapter"]["fresh"] and meta["adapter"]["targets"] == ["wq", "wk", "wv", "wo"]
    cfg = from_pretrained(tiny_dir).config
    kv = cfg.n_kv_heads * cfg.head_dim
    # per layer: down (3 x d_in) and up (d_out x 3) on each projection; plus the <mask> embedding
    per_layer = sum(3 * (d_in + d_out) for d_in, d_out in
                    [(cfg.dim, cfg.n_heads * cfg.head_dim), (cfg.dim, kv), (cfg.dim, kv),
                     (cfg.n_heads * cfg.head_dim, cfg.dim)])
    assert meta["adapter"]["parameters"] == cfg.n_layers * per_layer + cfg.dim


def test_a_fresh_adapter_changes_the_mask_positions(pass_runs, tiny_dir):
    """The fresh adapter loads as a trained one does, and its update is not zero: a mask
    position's logits differ from the base's, an ordinary position's do not."""
    from mtp.cli import load_model

    out, done = pass_runs["fresh"]
    assert done.returncode == 0, done.stderr
    model = load_model(str(out.parent / "fresh_adapter"), base=tiny_dir)[0]
    mask = model.config.mask_token_id
    tokens = torch.tensor([[5, 6, mask, mask]])
    with torch.no_grad():
        on, off = model(tokens), model(tokens, use_adapter=False)
    assert torch.equal(on[:, :2], off[:, :2]) and not torch.allclose(on[:, 2:], off[:, 2:])
    ups = [t for name, t in model.state_dict().items() if name.endswith("adapter.up")]
    assert len(ups) == 4 * model.config.n_layers and all(t.abs().sum() > 0 for t in ups)
    assert model.adapter_config["rank"] == 3


@pytest.mark.parametrize("name, message", [
    ("rank on an adapter", "is an adapter folder already"),
    ("base without rank", "give --rank"),
    ("targets without rank", "go with --rank"),
    ("k_max 1", "--k-max"),
    ("earlier output", "add --overwrite"),
])
def test_adapter_pass_bad_input_gives_one_error_line(pass_runs, name, message):
    out, done = pass_runs[name]
    assert done.returncode == 2
    assert name != "earlier output" or (out / "adapter_pass.json").read_text() == "{}"
    assert done.stderr.startswith("error:") and message in done.stderr
    assert done.stderr.count("\n") == 1


def test_the_latency_curve_of_an_adapter_folder_times_masks_with_the_adapter_on_and_off(
        adapter_dir, tmp_path):
    """On a gated adapter folder each latency pass is 1 token + (T - 1) <mask>s, without and with
    the adapter in turns, the lossless k_max among the sizes; the ratio printed is the adapter's
    pass at k_max over the one-token pass without it."""
    argv = ["--model", adapter_dir, "--out", str(tmp_path / "o"), "--parts", "latency", "--quick",
            "--latency-sizes", "2", "--latency-batch-sizes", "1", "--latency-repeats", "1",
            "--latency-dtypes", "float32", "--dtype", "float32", "--lossless-k", "3",
            "--threads", "1"]
    [done] = run_script(DECODE_REAL, argv, prelude=NOTE_PASSES)
    assert done.returncode == 0, done.stderr
    seen = passes_seen(done.stderr)
    assert seen[0][:2] == (0, 0)                                         # the prefill
    one_round = [(on, T - 1, T) for T in (1, 2, 3) for on in (0, 1)]
    # a warm-up round, then one timed
    assert seen[1:] == one_round * 2
    report = json.loads((tmp_path / "o" / "results.json").read_text())
    assert report["meta"]["adapter_k_max"] == 3
    off, on = report["latency_ms"]["float32"]["1"], report["adapter_latency_ms"]["float32"]["1"]
    assert set(off) == set(on) == {"1", "2", "3"}
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| 1 | float32, adapter on |" in md
    assert (f"Batch 1, float32: the adapter's pass of 1 token + 2 masks costs "
            f"{on['3'] / off['1']:.2f}x the one-token pass without the adapter.") in md
    assert (tmp_path / "o" / "latency.png").stat().st_size > 1000
