"""finetune_hf.py on tiny Hugging Face checkpoints: training, exact resume, FSDP2 on two
CPU processes, GSM8K scoring as lm-evaluation-harness does it, export to transformers,
bad input.

The tiny base model is written by transformers itself (LlamaForCausalLM.save_pretrained)
with the word-problem tokenizer beside it, exactly as a downloaded checkpoint would look.
"""
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import finetune_hf
from mtp.cli import read_rows
from mtp.finetune_cli import MODEL_CARD_TAGS, build_parser
from tasks.gsm8k import score
from data import (DOMAIN_TEMPLATES, QWEN2_PATTERN, Tokenizer, domain_prompts, gsm8k_row,
                  metamath_row, prompt_tokens, response_tokens, training_sequences,
                  word_problem, word_problem_batch, word_problem_split,
                  word_problem_tokenizer, write_word_problems)
from model import Transformer

REPO = Path(__file__).resolve().parents[1]
# float32: the comparisons are exact.
TRAIN = ["--seq-len", "48", "--batch-size", "4", "--micro-batch", "2",
         "--lr", "1e-3", "--warmup", "2",
         "--k-max", "6",
         "--save-every", "2", "--log-every", "1",
         "--dtype", "float32"]


# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def train_args(tiny_hf, out, *extra, model=None):
    model = model or tiny_hf / "base"
    return ["train", "--model", str(model), "--data", str(tiny_hf / "wp" / "train.json"),
            "--out", str(out), *TRAIN, *extra]


def tune(tiny_hf, out, *extra, model=None):
    """`train`, which must succeed."""
    assert finetune_hf.main(train_args(tiny_hf, out, *extra, model=model)) == 0


def export(checkpoint, out):
    """`export`, which must succeed."""
    assert finetune_hf.main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0


def weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


def json_file(path):
    return json.loads(Path(path).read_text())


def same(a: dict, b: dict) -> bool:
    """Every tensor of a equals b's of that name."""
    return all(torch.equal(a[n], b[n]) for n in a)


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_help_names_only_files_the_repository_has(capsys):
    """Every --help names only scripts the repository holds, and no placeholder."""
    for command in ([], ["train"], ["eval"], ["analyze"], ["data"], ["export"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        text = capsys.readouterr().out
        assert "usage: finetune_hf.py" in text
        assert "METHOD" not in text
        names = re.findall(r"[\w/]+\.py\b", text)
        assert all((REPO / f).is_file() for f in names)


# ---------------------------------------------------------------------------------------
# Data: word problems, formats, data order
# ---------------------------------------------------------------------------------------

def test_word_problems_formats_and_split():
    """Generated word problems: right arithmetic in both row formats, disjoint splits,
    one token per word or symbol."""
    rng = random.Random(3)
    for _ in range(50):
        p = word_problem(rng)
        row = metamath_row(p)
        gsm = gsm8k_row(p)
        assert row["response"].endswith(f"The answer is: {p.answer}")
        # The gold answer is parsed from '#### N'.
        assert score(row["response"], gsm["answer"])["flexible_ok"]
        for a, op, b, c in re.findall(r"<<(\d+)([-+*])(\d+)=(-?\d+)>>", gsm["answer"]):
            result = {"+": int(a) + int(b),
                      "-": int(a) - int(b),
                      "*": int(a) * int(b)}
            assert result[op] == int(c)

    train, test = word_problem_split(300, 50, seed=0)
    assert not {p.question for p in train} & {p.question for p in test}

    # One token per word or symbol.
    tok = word_problem_tokenizer()
    row = metamath_row(train[0])
    text = row["query"] + " " + row["response"]
    symbols = sum(text.count(s) for s in ".?,:$")
    assert len(tok.encode(text)) == len(text.split()) + symbols


def test_domain_prompts_hold_a_quarter_of_the_subjects_out():
    """Test prompts use held-out subjects (every fourth), never a training-only one."""
    for domain, spec in DOMAIN_TEMPLATES.items():
        train = domain_prompts(domain, 10**6)
        test = domain_prompts(domain, 10**6, "test")
        assert test
        assert not set(train) & set(test)
        assert len(set(train)) == len(train)
        held_out = spec["subjects"][3::4]
        assert all(any(x in p for x in held_out) for p in test)
        # Training-only subjects: never in a test prompt.
        for x in spec.get("train_subjects", []):
            assert any(x in p for p in train)
            assert not any(x in p for p in test)
        # A fixed order: the first n are a prefix.
        assert domain_prompts(domain, 5) == train[:5]


def test_formats_and_data_order(tiny_hf):
    """The plain format's tokens, the qwen format's leading <|endoftext|>, and a data
    order that is a function of the step alone."""
    tok = word_problem_tokenizer()
    ids = prompt_tokens(tok, "plain", "Q?") + response_tokens(tok, "plain", "A")
    expected = [tok.bos_id] + tok.encode("Q?\n\n") + tok.encode("A") + [tok.eos_id]
    assert ids == expected
    seqs, _ = training_sequences([("Q?", "A")], tok, "plain", 12)
    assert seqs.shape == (1, 12)
    assert seqs[0, len(ids):].eq(tok.eos_id).all()
    tok.add_special_token("<|endoftext|>")
    assert prompt_tokens(tok, "qwen", "Q?")[0] == tok.token_id("<|endoftext|>")

    # Data order: a pure function of the step; epochs are permutations.
    a = [finetune_hf.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    again = [finetune_hf.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    assert a == again
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:20]) == list(range(10))


# ---------------------------------------------------------------------------------------
# Training: atomic checkpoints, exact resume, FSDP2, export
# ---------------------------------------------------------------------------------------

def test_train_resume_is_exact_and_export_loads_in_transformers(tiny_hf, tmp_path, capsys,
                                                                 monkeypatch):
    """A run interrupted after step 3 and resumed equals an uninterrupted one bit for bit;
    its export loads in transformers and gives our logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = tmp_path / "full"
    cut = tmp_path / "cut"
    tune(tiny_hf, full, "--steps", "5")
    log = capsys.readouterr().out
    assert "step 5/5 | loss" in log
    assert "tok/s | ETA" in log

    class Interrupted(Exception):
        pass

    real = finetune_hf.train_step
    steps = []

    # After step 3; the last checkpoint is step 2.
    def crash_after_3(*a, **kw):
        steps.append(1)
        if len(steps) == 4:
            raise Interrupted
        return real(*a, **kw)

    monkeypatch.setattr(finetune_hf, "train_step", crash_after_3)
    args = build_parser().parse_args(train_args(tiny_hf, cut, "--steps", "5"))
    with pytest.raises(Interrupted):
        finetune_hf.train(args)
    monkeypatch.setattr(finetune_hf, "train_step", real)
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_000002"

    # A save that died halfway is ignored.
    (cut / "checkpoints" / ".step_000004.tmp").mkdir()
    tune(tiny_hf, cut, "--steps", "5", "--resume")
    assert "resumed from" in capsys.readouterr().out
    a = weights(full / "final")
    b = weights(cut / "final")
    assert a.keys() == b.keys()
    assert same(a, b)
    kept = sorted(p.name for p in (cut / "checkpoints").glob("step_*"))
    assert kept == ["step_000004", "step_000005"]

    # Export: loadable by transformers, <mask> in tokenizer and config, same logits as ours.
    final = full / "final"
    cfg = json_file(final / "config.json")
    hf_tok = AutoTokenizer.from_pretrained(final)
    mask_id = cfg["mask_token_id"]
    assert hf_tok.convert_tokens_to_ids("<mask>") == mask_id == word_problem_tokenizer().n_vocab
    assert hf_tok("3 apples <mask>")["input_ids"][-1] == mask_id
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ours = Transformer.from_pretrained(final)
    x = torch.tensor([hf_tok("Tom has 3 apples.<mask><mask>")["input_ids"]])
    torch.testing.assert_close(hf(x).logits, ours(x),
                               atol=1e-5, rtol=1e-4)
    card = (final / "README.md").read_text()
    assert "confadapt.py --model" in card
    assert "METHOD" not in card
    # The scripts it names exist.
    names = re.findall(r"[\w/]+\.py\b", card)
    assert all((REPO / f).is_file() for f in names)

    # The `export` command rebuilds the same folder from the last checkpoint.
    export(full, tmp_path / "exp")
    c = weights(tmp_path / "exp")
    assert same(a, c)


def test_resume_ignores_gpu_rng_states_of_another_machine(tiny_hf, tmp_path, capsys):
    """Checkpoints hold no per-GPU RNG state (nothing draws on it), so a resume never
    depends on how many GPUs it sees; a checkpoint that holds 8 GPUs' states resumes too."""
    out = tmp_path / "run"
    tune(tiny_hf, out, "--steps", "2", "--device", "cpu")
    path = out / "checkpoints" / "step_000002" / "trainer.pt"
    trainer = torch.load(path, weights_only=True)
    assert set(trainer) == {"step", "scheduler", "args", "rng_cpu"}
    trainer["rng_cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 8
    torch.save(trainer, path)
    tune(tiny_hf, out, "--steps", "3", "--resume", "--device", "cpu")
    assert "resumed from" in capsys.readouterr().out


def test_train_and_export_write_the_base_checkpoints_dtype(tiny_hf, tmp_path):
    """The exported dtype is the base checkpoint's, whichever device trained: `train` and a
    later `export` of the same run write identical files."""
    base = tmp_path / "bf16_base"
    shutil.copytree(tiny_hf / "base", base)
    cfg = json_file(base / "config.json")
    cfg.pop("torch_dtype", None)
    (base / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    out = tmp_path / "run"
    tune(tiny_hf, out, "--steps", "2", model=base)
    export(out, tmp_path / "exp")
    a = weights(out / "final")
    b = weights(tmp_path / "exp")
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert same(a, b)
    assert json_file(out / "final" / "config.json")["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in weights(tiny_hf / "base").values()} == {torch.float32}

    # A gated adapter is written in that dtype too.
    adapter = tmp_path / "adapter"
    tune(tiny_hf, adapter, "--steps", "1", "--adapter", "gated-lora", model=base)
    saved = load_file(str(adapter / "final" / "mask_adapter.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


def two_processes(tiny_hf, out, *extra):
    """`train` under torchrun: gloo, 2 CPU processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", str(REPO / "finetune_hf.py"),
           *train_args(tiny_hf, out, *extra)]
    run = subprocess.run(cmd, cwd=REPO, env=env, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_fsdp2_on_two_cpu_processes_matches_one_process(tiny_hf, tmp_path):
    """torchrun, gloo, 2 processes x micro-batch 1 x 2 accumulation steps == 1 process x
    micro-batch 4."""
    single = tmp_path / "single"
    sharded = tmp_path / "fsdp"
    tune(tiny_hf, single, "--steps", "3", "--micro-batch", "4")
    run = two_processes(tiny_hf, sharded, "--steps", "3", "--micro-batch", "1")
    assert "2 process(es)" in run.stdout
    a = weights(single / "final")
    b = weights(sharded / "final")
    base = weights(tiny_hf / "base")
    # It did train.
    change = max((a[n][:100] - base[n][:100]).abs().max()
                 for n in base)
    assert change > 1e-4
    for n in a:
        torch.testing.assert_close(a[n], b[n],
                                   atol=2e-6, rtol=1e-5)


def test_qwen3_tied_checkpoint_reuses_a_spare_row_and_uses_the_qwen_recipe(tmp_path):
    """Qwen3 layout: tied embeddings, spare rows after the tokenizer, <|endoftext|> first."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    wp = word_problem_tokenizer()
    n = len(wp.mergeable_ranks)
    special = {"<|endoftext|>": n, "<|im_start|>": n + 1, "<|im_end|>": n + 2}
    tok = Tokenizer(wp.mergeable_ranks, special, QWEN2_PATTERN, nfc=True,
                    eos_token="<|im_end|>", pad_token="<|endoftext|>")
    cfg = Qwen3Config(vocab_size=n + 8, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=256, eos_token_id=n + 2,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "qwen")
    tok.save_pretrained(tmp_path / "qwen")
    write_word_problems(tmp_path / "wp", n_train=16, n_test=2, seed=2)
    out = tmp_path / "out"
    tune(tmp_path, out, "--steps", "2", model=tmp_path / "qwen")
    assert json_file(out / "train_args.json")["format"] == "qwen"

    # A spare row, no growth.
    exported = json_file(out / "final" / "config.json")
    assert exported["mask_token_id"] == n + 3
    assert exported["vocab_size"] == n + 8
    hf = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    # Still tied.
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = [n] + tok.encode("Tom has 3 apples.\n\n") + [n + 3, n + 3]
    x = torch.tensor([ids])
    ours = Transformer.from_pretrained(out / "final")
    torch.testing.assert_close(hf(x).logits, ours(x),
                               atol=1e-5, rtol=1e-4)


def test_word_problem_base_model_trains_on_the_plain_format(tmp_path):
    """scripts/word_problem_base.py writes the data and a base model that `train` can tune;
    its training sequences are finetune_hf's "plain" format token for token."""
    import runpy
    script = runpy.run_path(str(REPO / "scripts" / "word_problem_base.py"))
    out = script["main"](["--out", str(tmp_path / "wp"), "--quick"])
    with pytest.raises(script["CliError"], match="base exists: .* add --restart"):
        script["main"](["--out", str(tmp_path / "wp"), "--quick"])
    cfg = json.loads((Path(out["base"]) / "config.json").read_text())
    assert cfg["mask_token_id"] is None and cfg["architectures"] == ["LlamaForCausalLM"]
    tok = Tokenizer.from_pretrained(out["base"])
    pairs = read_rows(out["train"], [("query", "response")])
    seqs, supervised = word_problem_batch(tok, pairs[:1] * 3, random.Random(0), 3, 96)
    assert torch.equal(seqs, training_sequences(pairs[:1] * 3, tok, "plain", 96)[0].long())
    # every token but <bos> is supervised, up to the first <eos>
    end = int((seqs[0] == tok.eos_id).nonzero()[0])
    assert supervised[0, 1:end + 1].all()
    assert supervised[0].sum() == end
    tuned = str(tmp_path / "tuned")
    args = ["train", "--model", out["base"], "--data", out["train"], "--out", tuned]
    assert finetune_hf.main([*args, *TRAIN, "--steps", "1"]) == 0


def test_gt_mode_and_activation_checkpointing(tiny_hf, tmp_path):
    """The naive ground-truth ablation trains, with activations recomputed in backward."""
    gt = tmp_path / "gt"
    tune(tiny_hf, gt, "--steps", "2", "--mode", "gt", "--activation-checkpointing")
    assert "the naive ground-truth" in (gt / "final" / "README.md").read_text()


def test_gated_adapter_trains_only_itself_resumes_exactly_and_exports_a_small_folder(
        tiny_hf, tmp_path, capsys, monkeypatch):
    """--adapter gated-lora: the optimizer holds the adapter and the <mask> embedding only,
    the base folder stays as it was, a resumed run equals an uninterrupted one, checkpoints
    hold no base weight, and final/ (and export) hold the adapter, which every loader reads
    with its base."""
    from model import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    before = weights(tiny_hf / "base")
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--adapter-alpha", "8"]
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    tune(tiny_hf, full, "--steps", "4", *adapter)
    final = full / "final"
    files = sorted(p.name for p in final.iterdir())
    assert files == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md"])
    saved = load_file(str(final / ADAPTER_WEIGHTS))
    assert all(".adapter." in n or n == "mask_embedding" for n in saved)
    # It did train.
    ups = [t for n, t in saved.items() if n.endswith(".up")]
    assert max(t.abs().max() for t in ups) > 0
    base_after = weights(tiny_hf / "base")
    assert same(before, base_after)

    # No base weight in a checkpoint.
    step_4 = full / "checkpoints" / "step_000004"
    ckpt_bytes = sum(f.stat().st_size
                     for f in step_4.rglob("*") if f.is_file())
    base_bytes = (tiny_hf / "base" / "model.safetensors").stat().st_size
    assert ckpt_bytes < base_bytes
    card = (final / "README.md").read_text()
    assert "not a LoRA" in card
    assert MODEL_CARD_TAGS in card

    real = finetune_hf.train_step
    steps = []

    def crash_after_3(*a, **kw):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(finetune_hf, "train_step", crash_after_3)
    argv = train_args(tiny_hf, cut, "--steps", "4", *adapter)
    assert finetune_hf.main(argv) != 0
    monkeypatch.setattr(finetune_hf, "train_step", real)
    # Another rank.
    argv = train_args(tiny_hf, cut, "--steps", "4", *adapter[:2], "--resume")
    assert finetune_hf.main(argv) == 2
    assert "--adapter-rank 4 -> 32" in capsys.readouterr().err
    tune(tiny_hf, cut, "--steps", "4", *adapter, "--resume")
    resumed = load_file(str(cut / "final" / ADAPTER_WEIGHTS))
    assert saved.keys() == resumed.keys()
    assert same(saved, resumed)
    export(full, tmp_path / "exp")
    exported = load_file(str(tmp_path / "exp" / ADAPTER_WEIGHTS))
    assert same(saved, exported)

    # eval reads base + adapter; its greedy answers are the untuned model's, word for word.
    common = ["eval", "--data", str(tiny_hf / "wp" / "test.jsonl"),
              "--prompt-style", "zeroshot", "--max-new-tokens", "8", "--batch-size", "2",
              "--static-k", "1", "--taus"]
    argv = common + ["--model", str(tiny_hf / "base"), "--out", str(tmp_path / "e0")]
    assert finetune_hf.main(argv) == 0
    argv = common + ["--model", str(final), "--out", str(tmp_path / "e1"), "--lossless-k", "3"]
    assert finetune_hf.main(argv) == 0
    answers = [[r["completion"] for r in jsonl(tmp_path / e / "samples.jsonl")]
               for e in ("e0", "e1")]
    greedy = answers[0]
    assert answers[1][: len(greedy)] == greedy
    assert answers[1][len(greedy):] == greedy


def test_gated_adapter_refuses_the_prefix_loss_and_an_adapter_as_base(tiny_hf, tmp_path, capsys):
    """The prefix loss cannot train a gated adapter, and an adapter folder is no base
    model: one error line each."""
    run = tmp_path / "run"
    argv = train_args(tiny_hf, run, "--adapter", "gated-lora", "--prefix-ntp-weight", "1")
    assert finetune_hf.main(argv) == 2
    assert "cannot change" in capsys.readouterr().err
    tune(tiny_hf, run, "--steps", "1", "--adapter", "gated-lora")
    again = train_args(tiny_hf, tmp_path / "again", "--adapter", "gated-lora",
                       model=run / "final")
    assert finetune_hf.main(again) == 2
    err = capsys.readouterr().err.strip()
    assert "is a gated mask adapter" in err
    assert "\n" not in err


def test_gated_adapter_under_fsdp2_on_two_cpu_processes_matches_one_process(tiny_hf, tmp_path):
    """The adapter sharded over 2 processes x micro-batch 1 trains what 1 process x
    micro-batch 4 does."""
    from model import ADAPTER_WEIGHTS
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "3"]
    single = tmp_path / "single"
    sharded = tmp_path / "fsdp"
    tune(tiny_hf, single, *adapter, "--micro-batch", "4")
    two_processes(tiny_hf, sharded, *adapter, "--micro-batch", "1")
    a = load_file(str(single / "final" / ADAPTER_WEIGHTS))
    b = load_file(str(sharded / "final" / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n],
                                   atol=2e-6, rtol=1e-5)


def test_gated_adapter_under_fsdp2_in_bfloat16(tiny_hf, tmp_path):
    """FSDP2's mixed precision for real: float32 shards, a bfloat16 computation. The
    adapter's step reads its KV cache (built from the float32 shards) in bfloat16."""
    out = tmp_path / "fsdp_bf16"
    two_processes(tiny_hf, out, "--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "2",
                  "--micro-batch", "1", "--dtype", "bfloat16")
    assert (out / "final" / "mask_adapter.safetensors").is_file()


# ---------------------------------------------------------------------------------------
# Targets, schedule, dtype, bad input
# ---------------------------------------------------------------------------------------

def test_response_only_supervises_the_response_and_not_the_prompt(tiny_hf, tmp_path):
    """--response-only: only the response is a target, so the same steps predict fewer,
    but some, tokens."""
    tok = Tokenizer.from_pretrained(tiny_hf / "base")
    pairs = [("Ann has 3 pens. How many pens does Ann have?", "Ann has 3 pens.\n#### 3"),
             ("Q", "12 + 3 = 15")]
    seqs, mask = training_sequences(pairs, tok, "plain", 40)
    for row, (prompt, response) in enumerate(pairs):
        n = len(prompt_tokens(tok, "plain", prompt))
        answer = response_tokens(tok, "plain", response)
        assert not mask[row, :n].any()
        assert mask[row, n:].all()
        assert seqs[row, n:n + len(answer)].tolist() == answer

    # The same steps (same rows, k and offset) with and without: fewer, but some,
    # predictions.
    n_pred = {}
    for flag in ([], ["--response-only"]):
        out = tmp_path / ("response" if flag else "all")
        tune(tiny_hf, out, "--steps", "3", *flag)
        n_pred[bool(flag)] = [r["n_pred"] for r in jsonl(out / "log.jsonl")]
    assert len(n_pred[True]) == 3
    # Per step: some, and fewer than without --response-only.
    pairs = zip(n_pred[True], n_pred[False])
    assert all(0 < r < a for r, a in pairs)
    card = (tmp_path / "response" / "final" / "README.md").read_text()
    assert "targets in the responses only" in card


def test_decay_takes_the_learning_rate_linearly_to_zero_over_the_last_steps(tiny_hf, tmp_path):
    out = tmp_path / "decay"
    tune(tiny_hf, out, "--steps", "6", "--warmup", "1", "--decay", "4")
    lrs = [r["lr"] for r in jsonl(out / "log.jsonl")]
    # The log's lr is the rate the step trained at: step s runs at min(1, (6 - s) / 4) of
    # the peak for s = 0..5, so 1, 1, 1, 0.75, 0.5, 0.25.
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert "then linear to 0 over the last 4," in (out / "final" / "README.md").read_text()


def test_bfloat16_training_on_cpu(tiny_hf, tmp_path):
    """bfloat16 autocast on the CPU trains, with finite losses."""
    out = tmp_path / "bf16"
    tune(tiny_hf, out, "--steps", "2", "--dtype", "bfloat16")
    log = jsonl(out / "log.jsonl")
    assert len(log) == 2
    assert all(math.isfinite(r["loss"]) for r in log)


def test_bad_input_gives_one_error_line(tiny_hf, tmp_path, capsys):
    """Bad rows, a folder without a tokenizer, a missing file, an unknown or absent
    device, a model without <mask>: exit code 2 and one error line each."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n')
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_hf / "base" / f, no_tok / f)
    base = str(tiny_hf / "base")
    train = str(tiny_hf / "wp" / "train.json")
    test = str(tiny_hf / "wp" / "test.jsonl")
    out = str(tmp_path / "o")
    cases = [
        (["train", "--model", base, "--data", str(bad), "--out", out],
         "'query' and 'response'"),
        (["train", "--model", str(no_tok), "--data", train, "--out", out],
         "no tokenizer.json"),
        (["eval", "--model", base, "--data", train, "--out", out],
         "'question' and 'answer'"),
        (["analyze", "--model", base, "--data", str(tmp_path / "missing.jsonl")],
         "no such file"),
        # Never a silent run on the CPU.
        (["train", "--model", base, "--data", train, "--out", out, "--device", "cuda:0"],
         "CUDA is not available"),
        (["eval", "--model", base, "--data", test, "--device", "gpu"],
         "unknown device 'gpu'"),
        (["eval", "--model", base, "--data", test, "--static-k", "2", "--taus", "--out", out],
         "mask"),
    ]
    for argv, expected in cases:
        assert finetune_hf.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and expected in err, err
