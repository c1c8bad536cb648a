"""finetune_hf.py on tiny Hugging Face checkpoints: training, exact resume, FSDP2 on two CPU
processes, GSM8K scoring as lm-evaluation-harness does it, export to transformers, bad input.

The tiny base model is written by transformers itself (LlamaForCausalLM.save_pretrained) with
the word-problem tokenizer beside it, exactly as a downloaded checkpoint would look.
"""
import argparse
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

import finetune_hf as F
from cli import read_rows
from confadapt import Generation
from data import (DOMAIN_TEMPLATES, QWEN2_PATTERN, Tokenizer, domain_prompts, gsm8k_row, metamath_row, prompt_tokens,
                  response_tokens, training_sequences, word_problem, word_problem_batch, word_problem_split,
                  word_problem_tokenizer, write_word_problems)

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--seq-len", "48", "--batch-size", "4", "--micro-batch", "2", "--lr", "1e-3", "--warmup", "2",
         "--k-max", "6", "--save-every", "2", "--log-every", "1", "--dtype", "float32"]   # exact comparisons


pytestmark = pytest.mark.usefixtures("one_thread")            # conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint in Hugging Face layout (+ tokenizer) and word-problem data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("finetune_hf")
    tok = word_problem_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    write_word_problems(root / "wp", n_train=64, n_test=6, seed=1)
    return root


def train_args(tiny, out, *extra):
    return ["train", "--model", str(tiny / "base"), "--data", str(tiny / "wp" / "train.json"),
            "--out", str(out), *TRAIN, *extra]


def weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


# ----------------------------------------------------------------------------------------------
# GSM8K scoring (lm-evaluation-harness gsm8k_cot semantics) on hand-written completions
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, strict, flexible, strict_ok, flexible_ok", [
    ("5 + 4 = 9. The answer is 9.", "9", "9", "9.", True, True),
    # The strict regex ends in an unescaped ".", which must eat one more character: with nothing
    # after the number, the group gives up its last digit.
    ("So 21 - 15 = 6. The answer is 42", "42", "4", "42", False, True),
    ("The answer is 42\n", "42", "4", "42", False, True),           # "." does not match a newline either
    ("The answer is 42 apples", "42", "42", "42", True, True),
    ("The answer is 1,234.", "1234", "1,234", "1,234.", True, True),
    ("She pays $1,234.", "1234", "[invalid]", "$1,234.", False, True),
    ("The answer is -3.", "-3", "-3", "-3.", True, True),
    # Strict takes the first match, flexible the last; followed by more text, the "." is captured
    # (and dropped again by the normalisation).
    ("The answer is 5. The answer is 6.", "6", "5.", "6.", False, True),
    ("3 + 4 = 7 apples and 2 pears", "7", "[invalid]", "2", False, False),
    ("no number here", "7", "[invalid]", "[invalid]", False, False),
    ("The answer is 18.", "#### 18", "18", "18.", True, True),        # everything up to '#### ' is ignored
])
def test_gsm8k_scoring(completion, gold, strict, flexible, strict_ok, flexible_ok):
    s = F.score(completion, gold)
    assert (s["strict"], s["flexible"]) == (strict, flexible)
    assert (s["strict_ok"], s["flexible_ok"]) == (strict_ok, flexible_ok)


def test_help_names_only_files_the_repository_has(capsys):
    for command in ([], ["train"], ["eval"], ["analyze"], ["data"], ["export"]):
        with pytest.raises(SystemExit):
            F.build_parser().parse_args([*command, "--help"])
        text = capsys.readouterr().out
        assert "usage: finetune_hf.py" in text and "METHOD" not in text
        assert all((REPO / f).is_file() for f in re.findall(r"[\w/]+\.py\b", text))


def test_gsm8k_prompt_and_stop_strings(tiny):
    prompt = F.fewshot_prompt("How many?")
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert prompt.endswith("The answer is 8.\n\nQ: How many?\nA:")
    assert prompt.count("Q: ") == 9 and prompt.count("\n\n") == 8

    # Stopping at a stop STRING: count tokens and passes up to the end of the pass that completed it.
    tok = word_problem_tokenizer()
    first = tok.encode("x. The answer is 3.\n\nQ: next</s>")                # the first stop string cuts
    assert F.completion_of(tok, Generation(first, [len(first)], False), set())[0] == "x. The answer is 3.\n\n"
    ids = tok.encode("Tom has 3. The answer is: 3\n\nQ: Ann has 5 more")
    q_at = next(i for i in range(len(ids)) if "Q:" in tok.decode(ids[: i + 1])) + 1   # tokens through "Q:"
    sizes = [3] * (len(ids) // 3) + ([len(ids) % 3] if len(ids) % 3 else [])
    text, n_tokens, passes = F.completion_of(tok, Generation(ids, sizes, False), stop_ids={tok.eos_id})
    assert text == "Tom has 3. The answer is: 3\n\n"
    assert passes == -(-q_at // 3) and n_tokens == min(3 * passes, len(ids))
    eos_ended = Generation(ids[:5] + [tok.eos_id], [4, 2], True)            # a stop TOKEN is dropped from the text
    assert F.completion_of(tok, eos_ended, stop_ids={tok.eos_id}) == (tok.decode(ids[:5]), 6, 2)


def test_mean_and_stderr_like_the_harness():
    mean, se = F.mean_and_stderr([1, 0, 1, 1])
    assert mean == 0.75 and se == pytest.approx(0.25)        # sample std 0.5 / sqrt(4)


# ----------------------------------------------------------------------------------------------
# Data: word problems, formats, data order
# ----------------------------------------------------------------------------------------------

def test_word_problems_formats_and_split():
    rng = random.Random(3)
    for _ in range(50):
        p = word_problem(rng)
        row, gsm = metamath_row(p), gsm8k_row(p)
        assert row["response"].endswith(f"The answer is: {p.answer}")
        assert F.score(row["response"], gsm["answer"])["flexible_ok"]      # gold parsed from '#### N'
        for a, op, b, c in re.findall(r"<<(\d+)([-+*])(\d+)=(-?\d+)>>", gsm["answer"]):
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
    train, test = word_problem_split(300, 50, seed=0)
    assert not {p.question for p in train} & {p.question for p in test}
    tok = word_problem_tokenizer()
    text = metamath_row(train[0])["query"] + " " + metamath_row(train[0])["response"]
    assert len(tok.encode(text)) == len(text.split()) + text.count(".") + text.count("?") + text.count(",") \
        + text.count(":") + text.count("$")                                # one token per word / symbol


def test_domain_prompts_hold_a_quarter_of_the_subjects_out():
    for domain, spec in DOMAIN_TEMPLATES.items():
        train, test = domain_prompts(domain, 10**6), domain_prompts(domain, 10**6, "test")
        assert test and not set(train) & set(test) and len(set(train)) == len(train)
        held_out = spec["subjects"][3::4]
        assert all(any(x in p for x in held_out) for p in test)
        for x in spec.get("train_subjects", []):             # training-only subjects: never a test prompt
            assert any(x in p for p in train) and not any(x in p for p in test)
        assert domain_prompts(domain, 5) == train[:5]         # a fixed order: the first n are a prefix


def test_formats_and_data_order(tiny):
    tok = word_problem_tokenizer()
    ids = prompt_tokens(tok, "plain", "Q?") + response_tokens(tok, "plain", "A")
    assert ids == [tok.bos_id] + tok.encode("Q?\n\n") + tok.encode("A") + [tok.eos_id]
    seqs, _ = F.training_sequences([("Q?", "A")], tok, "plain", 12)
    assert seqs.shape == (1, 12) and seqs[0, len(ids):].eq(tok.eos_id).all()
    tok.add_special_token("<|endoftext|>")
    assert F.prompt_tokens(tok, "qwen", "Q?")[0] == tok.token_id("<|endoftext|>")
    # Data order: a pure function of the step; epochs are permutations.
    a = [F.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    assert a == [F.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


# ----------------------------------------------------------------------------------------------
# Training: atomic checkpoints, exact resume, FSDP2, export
# ----------------------------------------------------------------------------------------------

def test_train_resume_is_exact_and_export_loads_in_transformers(tiny, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert F.main(train_args(tiny, full, "--steps", "5")) == 0
    log = capsys.readouterr().out
    assert "step 5/5 | loss" in log and "tok/s | ETA" in log

    class Interrupted(Exception):
        pass

    real, steps = F.train_step, []

    def crash_after_3(*a, **kw):
        steps.append(1)
        if len(steps) == 4:
            raise Interrupted                          # after step 3; the last checkpoint is step 2
        return real(*a, **kw)
    monkeypatch.setattr(F, "train_step", crash_after_3)
    args = F.build_parser().parse_args(train_args(tiny, cut, "--steps", "5"))
    with pytest.raises(Interrupted):
        F.train(args)
    monkeypatch.setattr(F, "train_step", real)
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_000002"
    (cut / "checkpoints" / ".step_000004.tmp").mkdir()          # a save that died halfway is ignored
    assert F.main(train_args(tiny, cut, "--steps", "5", "--resume")) == 0
    assert "resumed from" in capsys.readouterr().out
    a, b = weights(full / "final"), weights(cut / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert sorted(p.name for p in (cut / "checkpoints").glob("step_*")) == ["step_000004", "step_000005"]

    # Export: loadable by transformers, <mask> in tokenizer and config, same logits as ours.
    final = full / "final"
    cfg = json.loads((final / "config.json").read_text())
    hf_tok = AutoTokenizer.from_pretrained(final)
    assert hf_tok.convert_tokens_to_ids("<mask>") == cfg["mask_token_id"] == word_problem_tokenizer().n_vocab
    assert hf_tok("3 apples <mask>")["input_ids"][-1] == cfg["mask_token_id"]
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ours = F.Transformer.from_pretrained(final)
    x = torch.tensor([hf_tok("Tom has 3 apples.<mask><mask>")["input_ids"]])
    torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=1e-4)
    card = (final / "README.md").read_text()
    assert "confadapt.py --model" in card and "METHOD" not in card
    assert all((REPO / f).is_file() for f in re.findall(r"[\w/]+\.py\b", card))   # the scripts it names exist
    # The `export` command rebuilds the same folder from the last checkpoint.
    assert F.main(["export", "--checkpoint", str(full), "--out", str(tmp_path / "exp")]) == 0
    c = weights(tmp_path / "exp")
    assert all(torch.equal(a[n], c[n]) for n in a)


def test_resume_ignores_gpu_rng_states_of_another_machine(tiny, tmp_path, capsys):
    """Checkpoints hold no per-GPU RNG state (nothing draws on it), so a resume never depends on
    how many GPUs it sees; a checkpoint that holds 8 GPUs' states resumes too."""
    out = tmp_path / "run"
    assert F.main(train_args(tiny, out, "--steps", "2", "--device", "cpu")) == 0
    path = out / "checkpoints" / "step_000002" / "trainer.pt"
    trainer = torch.load(path, weights_only=True)
    assert set(trainer) == {"step", "scheduler", "args", "rng_cpu"}
    trainer["rng_cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 8
    torch.save(trainer, path)
    assert F.main(train_args(tiny, out, "--steps", "3", "--resume", "--device", "cpu")) == 0
    assert "resumed from" in capsys.readouterr().out


def test_train_and_export_write_the_base_checkpoints_dtype(tiny, tmp_path):
    """The exported dtype is the base checkpoint's, whichever device trained: `train` and a later
    `export` of the same run write identical files."""
    base = tmp_path / "bf16_base"
    shutil.copytree(tiny / "base", base)
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    (base / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    out = tmp_path / "run"
    assert F.main(["train", "--model", str(base), "--data", str(tiny / "wp" / "train.json"), "--out", str(out),
                   *TRAIN, "--steps", "2"]) == 0
    assert F.main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "exp")]) == 0
    a, b = weights(out / "final"), weights(tmp_path / "exp")
    assert {t.dtype for t in a.values()} == {torch.bfloat16} and all(torch.equal(a[n], b[n]) for n in a)
    assert json.loads((out / "final" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in weights(tiny / "base").values()} == {torch.float32}
    adapter = tmp_path / "adapter"                  # a gated adapter is written in that dtype too
    assert F.main(["train", "--model", str(base), "--data", str(tiny / "wp" / "train.json"), "--out", str(adapter),
                   *TRAIN, "--steps", "1", "--adapter", "gated-lora"]) == 0
    saved = load_file(str(adapter / "final" / "mask_adapter.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


def test_fsdp2_on_two_cpu_processes_matches_one_process(tiny, tmp_path):
    """torchrun, gloo, 2 processes x micro-batch 1 x 2 accumulation steps == 1 process x micro-batch 4."""
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    assert F.main(train_args(tiny, single, "--steps", "3", "--micro-batch", "4")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "finetune_hf.py"), *train_args(tiny, sharded, "--steps", "3", "--micro-batch", "1")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es)" in run.stdout
    a, b = weights(single / "final"), weights(sharded / "final")
    base = weights(tiny / "base")
    assert max((a[n][:100] - base[n][:100]).abs().max() for n in base) > 1e-4        # it did train
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=2e-6, rtol=1e-5)


def test_fsdp2_teacher_gives_back_its_gathered_root_after_each_forward(tiny, tmp_path):
    """The frozen teacher runs no backward, so FSDP2 must reshard its root (the embedding and the
    output layer, about 2 GB for an 8B model) right after its forward, or every rank keeps them
    whole for the run. One process in a gloo group of one is enough to see it."""
    from torch.distributed.tensor import DTensor

    store = f"file://{tmp_path / 'store'}"
    torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        d = F.Dist(rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32, sharded=True)
        args = argparse.Namespace(model=str(tiny / "base"))
        _, teacher, _, _ = F.load_student_and_teacher(args, d)
        with torch.no_grad():
            teacher(torch.zeros(1, 4, dtype=torch.long))
        assert isinstance(teacher.tok_emb.weight, DTensor)          # sharded again, not held whole
        assert isinstance(teacher.layers[0].attn.wq.weight, DTensor)
    finally:
        torch.distributed.destroy_process_group()


def test_qwen3_tied_checkpoint_reuses_a_spare_row_and_uses_the_qwen_recipe(tmp_path):
    """Qwen3 layout: tied embeddings, spare rows after the tokenizer, <|endoftext|> first."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    wp = word_problem_tokenizer()
    n = len(wp.mergeable_ranks)
    tok = Tokenizer(wp.mergeable_ranks, {"<|endoftext|>": n, "<|im_start|>": n + 1, "<|im_end|>": n + 2},
                    QWEN2_PATTERN, nfc=True, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    cfg = Qwen3Config(vocab_size=n + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      eos_token_id=n + 2, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "qwen")
    tok.save_pretrained(tmp_path / "qwen")
    write_word_problems(tmp_path / "wp", n_train=16, n_test=2, seed=2)
    out = tmp_path / "out"
    assert F.main(["train", "--model", str(tmp_path / "qwen"), "--data", str(tmp_path / "wp" / "train.json"),
                   "--out", str(out), *TRAIN, "--steps", "2"]) == 0
    assert json.loads((out / "train_args.json").read_text())["format"] == "qwen"
    exported = json.loads((out / "final" / "config.json").read_text())
    assert exported["mask_token_id"] == n + 3 and exported["vocab_size"] == n + 8      # a spare row, no growth
    hf = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()   # still tied
    x = torch.tensor([[n] + tok.encode("Tom has 3 apples.\n\n") + [n + 3, n + 3]])
    torch.testing.assert_close(hf(x).logits, F.Transformer.from_pretrained(out / "final")(x), atol=1e-5, rtol=1e-4)


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
    assert torch.equal(seqs, F.training_sequences(pairs[:1] * 3, tok, "plain", 96)[0].long())
    end = int((seqs[0] == tok.eos_id).nonzero()[0])                   # the first <eos>
    assert supervised[0, 1:end + 1].all() and supervised[0].sum() == end   # all but <bos>, up to <eos>
    assert F.main(["train", "--model", out["base"], "--data", out["train"], "--out", str(tmp_path / "tuned"), *TRAIN,
                   "--steps", "1"]) == 0


def test_gt_mode_and_activation_checkpointing(tiny, tmp_path):
    gt = tmp_path / "gt"
    assert F.main(train_args(tiny, gt, "--steps", "2", "--mode", "gt", "--activation-checkpointing")) == 0
    assert "the naive ground-truth" in (gt / "final" / "README.md").read_text()


def test_gated_adapter_trains_only_itself_resumes_exactly_and_exports_a_small_folder(tiny, tmp_path, capsys,
                                                                                     monkeypatch):
    """--adapter gated-lora: the optimizer holds the adapter and the <mask> embedding only, the base
    folder stays as it was, a resumed run equals an uninterrupted one, checkpoints hold no base
    weight, and final/ (and export) hold the adapter, which every loader reads with its base."""
    from model import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    before = weights(tiny / "base")
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--adapter-alpha", "8"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert F.main(train_args(tiny, full, "--steps", "4", *adapter)) == 0
    final = full / "final"
    assert sorted(p.name for p in final.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md"])
    saved = load_file(str(final / ADAPTER_WEIGHTS))
    assert all(".adapter." in n or n == "mask_embedding" for n in saved)
    assert max(t.abs().max() for n, t in saved.items() if n.endswith(".up")) > 0          # it did train
    base_after = weights(tiny / "base")
    assert all(torch.equal(before[n], base_after[n]) for n in before)
    ckpt_bytes = sum(f.stat().st_size for f in (full / "checkpoints" / "step_000004").rglob("*") if f.is_file())
    base_bytes = (tiny / "base" / "model.safetensors").stat().st_size
    assert ckpt_bytes < base_bytes                             # no base weight in a checkpoint
    card = (final / "README.md").read_text()
    assert "not a LoRA" in card and F.MODEL_CARD_TAGS in card

    real, steps = F.train_step, []
    def crash_after_3(*a, **kw):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(F, "train_step", crash_after_3)
    assert F.main(train_args(tiny, cut, "--steps", "4", *adapter)) != 0
    monkeypatch.setattr(F, "train_step", real)
    assert F.main(train_args(tiny, cut, "--steps", "4", *adapter[:2], "--resume")) == 2   # another rank
    assert "--adapter-rank 4 -> 32" in capsys.readouterr().err
    assert F.main(train_args(tiny, cut, "--steps", "4", *adapter, "--resume")) == 0
    resumed = load_file(str(cut / "final" / ADAPTER_WEIGHTS))
    assert saved.keys() == resumed.keys() and all(torch.equal(saved[n], resumed[n]) for n in saved)
    assert F.main(["export", "--checkpoint", str(full), "--out", str(tmp_path / "exp")]) == 0
    exported = load_file(str(tmp_path / "exp" / ADAPTER_WEIGHTS))
    assert all(torch.equal(saved[n], exported[n]) for n in saved)

    # eval reads base + adapter; its greedy answers are the untuned model's, word for word.
    common = ["eval", "--data", str(tiny / "wp" / "test.jsonl"), "--prompt-style", "zeroshot",
              "--max-new-tokens", "8", "--batch-size", "2", "--static-k", "1", "--taus"]
    assert F.main(common + ["--model", str(tiny / "base"), "--out", str(tmp_path / "e0")]) == 0
    assert F.main(common + ["--model", str(final), "--out", str(tmp_path / "e1"), "--lossless-k", "3"]) == 0
    answers = [[json.loads(line)["completion"] for line in (tmp_path / e / "samples.jsonl").read_text().splitlines()]
               for e in ("e0", "e1")]
    assert answers[1][: len(answers[0])] == answers[0] and answers[1][len(answers[0]):] == answers[0]


def test_gated_adapter_refuses_the_prefix_loss_and_an_adapter_as_base(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    assert F.main(train_args(tiny, run, "--adapter", "gated-lora", "--prefix-ntp-weight", "1")) == 2
    assert "cannot change" in capsys.readouterr().err
    assert F.main(train_args(tiny, run, "--steps", "1", "--adapter", "gated-lora")) == 0
    again = ["train", "--model", str(run / "final"), "--data", str(tiny / "wp" / "train.json"),
             "--out", str(tmp_path / "again"), *TRAIN, "--adapter", "gated-lora"]
    assert F.main(again) == 2
    err = capsys.readouterr().err.strip()
    assert "is a gated mask adapter" in err and "\n" not in err


def test_gated_adapter_under_fsdp2_on_two_cpu_processes_matches_one_process(tiny, tmp_path):
    from model import ADAPTER_WEIGHTS
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "3"]
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    assert F.main(train_args(tiny, single, *adapter, "--micro-batch", "4")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "finetune_hf.py"), *train_args(tiny, sharded, *adapter, "--micro-batch", "1")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = (load_file(str(p / "final" / ADAPTER_WEIGHTS)) for p in (single, sharded))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=2e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# eval and analyze end to end, and bad input
# ----------------------------------------------------------------------------------------------

def test_eval_sweep_writes_table_and_plot(tiny, tmp_path):
    model = tmp_path / "m"
    assert F.main(train_args(tiny, model, "--steps", "1")) == 0
    out = tmp_path / "eval"
    common = ["eval", "--model", str(model / "final"), "--data", str(tiny / "wp" / "test.jsonl"), "--out", str(out),
              "--max-new-tokens", "6", "--batch-size", "2"]
    assert F.main(common + ["--prompt-style", "zeroshot", "--static-k", "1", "3", "--taus", "0.9",
                            "--lossless-k", "4"]) == 0
    meta, res = (json.loads((out / "results.json").read_text())[key] for key in ("meta", "results"))
    assert meta["commit"] is None or re.fullmatch("[0-9a-f]{40}", meta["commit"])   # provenance: None outside git
    assert meta["cpu"] and meta["dtype"] in ("float32", "bfloat16") and meta["torch"] == torch.__version__
    assert json.loads((out / "samples.jsonl").read_text().splitlines()[0])["gold"].isdigit()   # after '####'
    assert [r["decoding"] for r in res] == ["k=1 (greedy)", "static k=3", "confadapt tau=0.9 k_max=16",
                                            "lossless k=4"]
    assert res[0]["effective_k_mean"] == 1.0 and res[1]["effective_k_mean"] > 1.0
    assert res[3]["flexible_acc"] == res[0]["flexible_acc"]                      # lossless == greedy
    assert "| static k=3 |" in (out / "results.md").read_text() and (out / "pareto.png").stat().st_size > 0
    again = common + ["--limit", "1", "--static-k", "1", "--taus"]             # 8-shot prompt
    assert F.main(again) == 2                                    # --out holds an earlier eval
    assert F.main(again + ["--overwrite"]) == 0


def test_analyze_estimates(tiny, tmp_path):
    # ConfAdapt simulated on hand-made confidences
    conf = [0.5, 0.95, 0.95, 0.5]
    assert F.simulated_passes(conf, 0.9, 16, joint=False) == 3       # [0.5] [.95 .95] [0.5]: a pass stops at
    assert F.simulated_passes(conf, 0.9, 16, joint=True) == 3        # an unsure token, as ConfAdapt does
    assert F.simulated_passes([0.95] * 4, 0.9, 16, joint=False) == 1  # [.95 .95 .95 .95]
    assert F.simulated_passes([0.95] * 4, 0.9, 16, joint=True) == 2   # [.95 .95] [.95 .95]: .95^3 < 0.9
    assert F.simulated_passes([1.0] * 10, 0.9, 4, joint=True) == 3   # k_max caps a pass
    out = tmp_path / "an"
    assert F.main(["analyze", "--model", str(tiny / "base"), "--data", str(tiny / "wp" / "test.jsonl"),
                   "--limit", "2", "--max-new-tokens", "4", "--taus", "0.9", "--out", str(out)]) == 0
    report = json.loads((out / "analysis.json").read_text())["domains"]["test.jsonl"]
    assert report["tokens"] > 0 and report["estimates"][0]["effective_k_per_token"] >= 1.0
    again = ["analyze", "--model", str(tiny / "base"), "--domains", "lists", "word_problems", "--limit", "2",
             "--max-new-tokens", "4", "--taus", "0.9", "0.5", "--out", str(out)]
    assert F.main(again) == 2                                    # --out holds an earlier analysis
    assert F.main(again + ["--overwrite"]) == 0
    report = json.loads((out / "analysis.json").read_text())["domains"]
    assert list(report) == ["lists", "word_problems"] and len(report["lists"]["estimates"]) == 2
    assert "| lists | 2 |" in (out / "analysis.md").read_text()


def test_data_writes_the_models_own_answers_and_train_reads_them(tiny, tmp_path):
    rows_file = tmp_path / "own.jsonl"
    assert F.main(["data", "--model", str(tiny / "base"), "--out", str(rows_file), "--domains", "lists", "writing",
                   "--per-domain", "3", "--max-new-tokens", "5"]) == 0
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["domain"] for r in rows] == ["lists"] * 3 + ["writing"] * 3
    assert rows[0]["prompt"] in domain_prompts("lists", 3) and all(isinstance(r["response"], str) for r in rows)
    out = tmp_path / "run"
    assert F.main(["train", "--model", str(tiny / "base"), "--data", str(rows_file), str(tiny / "wp" / "train.json"),
                   "--out", str(out), *TRAIN, "--steps", "2", "--prefix-ntp-weight", "0.5"]) == 0
    assert json.loads((out / "train_args.json").read_text())["prefix_ntp_weight"] == 0.5
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(r["loss"] == r["loss"] for r in log)


def test_response_only_supervises_the_response_and_not_the_prompt(tiny, tmp_path):
    tok = Tokenizer.from_pretrained(tiny / "base")
    pairs = [("Ann has 3 pens. How many pens does Ann have?", "Ann has 3 pens.\n#### 3"), ("Q", "12 + 3 = 15")]
    seqs, mask = training_sequences(pairs, tok, "plain", 40)
    for row, (prompt, response) in enumerate(pairs):
        n, answer = len(prompt_tokens(tok, "plain", prompt)), response_tokens(tok, "plain", response)
        assert not mask[row, :n].any() and mask[row, n:].all()
        assert seqs[row, n:n + len(answer)].tolist() == answer
    # The same steps (same rows, k and offset) with and without: fewer, but some, predictions.
    n_pred = {}
    for flag in ([], ["--response-only"]):
        out = tmp_path / ("response" if flag else "all")
        assert F.main(train_args(tiny, out, "--steps", "3", *flag)) == 0
        n_pred[bool(flag)] = [json.loads(line)["n_pred"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(n_pred[True]) == 3 and all(0 < r < a for r, a in zip(n_pred[True], n_pred[False]))
    assert "targets in the responses only" in (tmp_path / "response" / "final" / "README.md").read_text()


def test_decay_takes_the_learning_rate_linearly_to_zero_over_the_last_steps(tiny, tmp_path):
    out = tmp_path / "decay"
    assert F.main(train_args(tiny, out, "--steps", "6", "--warmup", "1", "--decay", "4")) == 0
    lrs = [json.loads(line)["lr"] for line in (out / "log.jsonl").read_text().splitlines()]
    # The log's lr is the rate the step trained at: step s runs at min(1, (6 - s) / 4) of the peak
    # for s = 0..5, so 1, 1, 1, 0.75, 0.5, 0.25.
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert "then linear to 0 over the last 4," in (out / "final" / "README.md").read_text()


def test_bfloat16_training_on_cpu(tiny, tmp_path):
    assert F.main(train_args(tiny, tmp_path / "bf16", "--steps", "2", "--dtype", "bfloat16")) == 0
    log = [json.loads(line) for line in (tmp_path / "bf16" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(math.isfinite(r["loss"]) for r in log)


def test_auto_compute_dtype_on_a_gpu_that_only_emulates_bfloat16(monkeypatch):
    """A T4 or V100 says yes to torch.cuda.is_bf16_supported() counting emulation: float32 there."""
    def t4(including_emulation=True):
        return including_emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", t4)
    assert F.compute_dtype("cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert F.compute_dtype("cuda") == torch.bfloat16


def test_bad_input_gives_one_error_line(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n')
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / "base" / f, no_tok / f)
    cases = [
        (["train", "--model", str(tiny / "base"), "--data", str(bad), "--out", str(tmp_path / "o")], "'query' and 'response'"),
        (["train", "--model", str(no_tok), "--data", str(tiny / "wp" / "train.json"), "--out", str(tmp_path / "o")],
         "no tokenizer.json"),
        (["eval", "--model", str(tiny / "base"), "--data", str(tiny / "wp" / "train.json"), "--out", str(tmp_path / "o")],
         "'question' and 'answer'"),
        (["analyze", "--model", str(tiny / "base"), "--data", str(tmp_path / "missing.jsonl")], "no such file"),
        (["train", "--model", str(tiny / "base"), "--data", str(tiny / "wp" / "train.json"), "--out", str(tmp_path / "o"),
          "--device", "cuda:0"], "CUDA is not available"),                   # never a silent run on the CPU
        (["eval", "--model", str(tiny / "base"), "--data", str(tiny / "wp" / "test.jsonl"), "--device", "gpu"],
         "unknown device 'gpu'"),
        (["eval", "--model", str(tiny / "base"), "--data", str(tiny / "wp" / "test.jsonl"), "--static-k", "2",
          "--taus", "--out", str(tmp_path / "o")], "mask"),
    ]
    for argv, expected in cases:
        assert F.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and expected in err, err
