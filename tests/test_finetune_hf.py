"""finetune_hf.py on tiny Hugging Face checkpoints: training, exact resume, FSDP2 on two
CPU processes, GSM8K scoring as lm-evaluation-harness does it, export to transformers,
bad input.

The tiny base model is written by transformers itself (LlamaForCausalLM.save_pretrained)
with the word-problem tokenizer beside it, exactly as a downloaded checkpoint would look.
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
from mtp.cli import read_rows
from mtp.hf import from_pretrained
from mtp.engine import Generation
from data import (DOMAIN_TEMPLATES, QWEN2_PATTERN, Tokenizer, domain_prompts, gsm8k_row,
                  metamath_row, prompt_tokens, response_tokens, training_sequences,
                  word_problem, word_problem_batch, word_problem_split,
                  word_problem_tokenizer, write_word_problems)

REPO = Path(__file__).resolve().parents[1]
# float32: the comparisons are exact.
TRAIN = ["--seq-len", "48", "--batch-size", "4", "--micro-batch", "2",
         "--lr", "1e-3", "--warmup", "2",
         "--k-max", "6",
         "--save-every", "2", "--log-every", "1",
         "--dtype", "float32"]


# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint in Hugging Face layout (+ tokenizer) and word-problem data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("finetune_hf")
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


def train_args(tiny, out, *extra, model=None):
    model = model or tiny / "base"
    return ["train", "--model", str(model), "--data", str(tiny / "wp" / "train.json"),
            "--out", str(out), *TRAIN, *extra]


def tune(tiny, out, *extra, model=None):
    """`train`, which must succeed."""
    assert F.main(train_args(tiny, out, *extra, model=model)) == 0


def export(checkpoint, out):
    """`export`, which must succeed."""
    assert F.main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0


def weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


def json_file(path):
    return json.loads(Path(path).read_text())


def same(a: dict, b: dict) -> bool:
    """Every tensor of a equals b's of that name."""
    return all(torch.equal(a[n], b[n]) for n in a)


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ---------------------------------------------------------------------------------------
# GSM8K scoring (lm-evaluation-harness gsm8k_cot semantics) on hand-written completions
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, strict, flexible, strict_ok, flexible_ok", [
    ("5 + 4 = 9. The answer is 9.", "9",
     "9", "9.", True, True),
    # The strict regex ends in an unescaped ".", which must eat one more character: with
    # nothing after the number, the group gives up its last digit.
    ("So 21 - 15 = 6. The answer is 42", "42",
     "4", "42", False, True),
    # "." does not match a newline either.
    ("The answer is 42\n", "42",
     "4", "42", False, True),
    ("The answer is 42 apples", "42",
     "42", "42", True, True),
    ("The answer is 1,234.", "1234",
     "1,234", "1,234.", True, True),
    ("She pays $1,234.", "1234",
     "[invalid]", "$1,234.", False, True),
    ("The answer is -3.", "-3",
     "-3", "-3.", True, True),
    # Strict takes the first match, flexible the last; followed by more text, the "." is
    # captured (and dropped again by the normalisation).
    ("The answer is 5. The answer is 6.", "6",
     "5.", "6.", False, True),
    ("3 + 4 = 7 apples and 2 pears", "7",
     "[invalid]", "2", False, False),
    ("no number here", "7",
     "[invalid]", "[invalid]", False, False),
    # Everything up to '#### ' is ignored.
    ("The answer is 18.", "#### 18",
     "18", "18.", True, True),
])
def test_gsm8k_scoring(completion, gold, strict, flexible, strict_ok, flexible_ok):
    """score() extracts and compares as lm-evaluation-harness's gsm8k_cot does, its
    quirks included."""
    s = F.score(completion, gold)
    assert (s["strict"], s["flexible"]) == (strict, flexible)
    assert (s["strict_ok"], s["flexible_ok"]) == (strict_ok, flexible_ok)


def test_help_names_only_files_the_repository_has(capsys):
    """Every --help names only scripts the repository holds, and no placeholder."""
    for command in ([], ["train"], ["eval"], ["analyze"], ["data"], ["export"]):
        with pytest.raises(SystemExit):
            F.build_parser().parse_args([*command, "--help"])
        text = capsys.readouterr().out
        assert "usage: finetune_hf.py" in text
        assert "METHOD" not in text
        names = re.findall(r"[\w/]+\.py\b", text)
        assert all((REPO / f).is_file() for f in names)


def test_gsm8k_prompt_and_stop_strings(tiny):
    """The 8-shot prompt's shape; a completion ends at its first stop string, counted up
    to the end of the pass that made it."""
    prompt = F.fewshot_prompt("How many?")
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert prompt.endswith("The answer is 8.\n\nQ: How many?\nA:")
    assert prompt.count("Q: ") == 9
    assert prompt.count("\n\n") == 8

    # Stopping at a stop STRING: count tokens and passes up to the end of the pass that
    # completed it. The first stop string cuts.
    tok = word_problem_tokenizer()
    first = tok.encode("x. The answer is 3.\n\nQ: next</s>")
    gen = Generation(first, [len(first)], False)
    text = F.completion_of(tok, gen, set())[0]
    assert text == "x. The answer is 3.\n\n"

    ids = tok.encode("Tom has 3. The answer is: 3\n\nQ: Ann has 5 more")
    # The tokens through "Q:".
    q_at = next(i for i in range(len(ids))
                if "Q:" in tok.decode(ids[: i + 1])) + 1
    # Passes of 3 tokens; the last one may be shorter.
    sizes = [3] * (len(ids) // 3)
    if len(ids) % 3:
        sizes.append(len(ids) % 3)
    gen = Generation(ids, sizes, False)
    text, n_tokens, passes = F.completion_of(tok, gen, stop_ids={tok.eos_id})
    assert text == "Tom has 3. The answer is: 3\n\n"
    assert passes == -(-q_at // 3)
    assert n_tokens == min(3 * passes, len(ids))

    # A stop TOKEN is dropped from the text.
    eos_ended = Generation(ids[:5] + [tok.eos_id], [4, 2], True)
    completion = F.completion_of(tok, eos_ended, stop_ids={tok.eos_id})
    assert completion == (tok.decode(ids[:5]), 6, 2)


def test_mean_and_stderr_like_the_harness():
    """The standard error is the sample standard deviation over sqrt(n)."""
    mean, se = F.mean_and_stderr([1, 0, 1, 1])
    # The sample std 0.5 / sqrt(4).
    assert mean == 0.75
    assert se == pytest.approx(0.25)


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
        assert F.score(row["response"], gsm["answer"])["flexible_ok"]
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


def test_formats_and_data_order(tiny):
    """The plain format's tokens, the qwen format's leading <|endoftext|>, and a data
    order that is a function of the step alone."""
    tok = word_problem_tokenizer()
    ids = prompt_tokens(tok, "plain", "Q?") + response_tokens(tok, "plain", "A")
    expected = [tok.bos_id] + tok.encode("Q?\n\n") + tok.encode("A") + [tok.eos_id]
    assert ids == expected
    seqs, _ = F.training_sequences([("Q?", "A")], tok, "plain", 12)
    assert seqs.shape == (1, 12)
    assert seqs[0, len(ids):].eq(tok.eos_id).all()
    tok.add_special_token("<|endoftext|>")
    assert F.prompt_tokens(tok, "qwen", "Q?")[0] == tok.token_id("<|endoftext|>")

    # Data order: a pure function of the step; epochs are permutations.
    a = [F.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    again = [F.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    assert a == again
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:20]) == list(range(10))


# ---------------------------------------------------------------------------------------
# Training: atomic checkpoints, exact resume, FSDP2, export
# ---------------------------------------------------------------------------------------

def test_train_resume_is_exact_and_export_loads_in_transformers(tiny, tmp_path, capsys,
                                                                 monkeypatch):
    """A run interrupted after step 3 and resumed equals an uninterrupted one bit for bit;
    its export loads in transformers and gives our logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = tmp_path / "full"
    cut = tmp_path / "cut"
    tune(tiny, full, "--steps", "5")
    log = capsys.readouterr().out
    assert "step 5/5 | loss" in log
    assert "tok/s | ETA" in log

    class Interrupted(Exception):
        pass

    real = F.train_step
    steps = []

    # After step 3; the last checkpoint is step 2.
    def crash_after_3(*a, **kw):
        steps.append(1)
        if len(steps) == 4:
            raise Interrupted
        return real(*a, **kw)

    monkeypatch.setattr(F, "train_step", crash_after_3)
    args = F.build_parser().parse_args(train_args(tiny, cut, "--steps", "5"))
    with pytest.raises(Interrupted):
        F.train(args)
    monkeypatch.setattr(F, "train_step", real)
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_000002"

    # A save that died halfway is ignored.
    (cut / "checkpoints" / ".step_000004.tmp").mkdir()
    tune(tiny, cut, "--steps", "5", "--resume")
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
    ours = from_pretrained(final)
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


def test_resume_ignores_gpu_rng_states_of_another_machine(tiny, tmp_path, capsys):
    """Checkpoints hold no per-GPU RNG state (nothing draws on it), so a resume never
    depends on how many GPUs it sees; a checkpoint that holds 8 GPUs' states resumes too."""
    out = tmp_path / "run"
    tune(tiny, out, "--steps", "2", "--device", "cpu")
    path = out / "checkpoints" / "step_000002" / "trainer.pt"
    trainer = torch.load(path, weights_only=True)
    assert set(trainer) == {"step", "scheduler", "args", "rng_cpu"}
    trainer["rng_cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 8
    torch.save(trainer, path)
    tune(tiny, out, "--steps", "3", "--resume", "--device", "cpu")
    assert "resumed from" in capsys.readouterr().out


def test_train_and_export_write_the_base_checkpoints_dtype(tiny, tmp_path):
    """The exported dtype is the base checkpoint's, whichever device trained: `train` and a
    later `export` of the same run write identical files."""
    base = tmp_path / "bf16_base"
    shutil.copytree(tiny / "base", base)
    cfg = json_file(base / "config.json")
    cfg.pop("torch_dtype", None)
    (base / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    out = tmp_path / "run"
    tune(tiny, out, "--steps", "2", model=base)
    export(out, tmp_path / "exp")
    a = weights(out / "final")
    b = weights(tmp_path / "exp")
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert same(a, b)
    assert json_file(out / "final" / "config.json")["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in weights(tiny / "base").values()} == {torch.float32}

    # A gated adapter is written in that dtype too.
    adapter = tmp_path / "adapter"
    tune(tiny, adapter, "--steps", "1", "--adapter", "gated-lora", model=base)
    saved = load_file(str(adapter / "final" / "mask_adapter.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


def two_processes(tiny, out, *extra):
    """`train` under torchrun: gloo, 2 CPU processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", str(REPO / "finetune_hf.py"),
           *train_args(tiny, out, *extra)]
    run = subprocess.run(cmd, cwd=REPO, env=env, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_fsdp2_on_two_cpu_processes_matches_one_process(tiny, tmp_path):
    """torchrun, gloo, 2 processes x micro-batch 1 x 2 accumulation steps == 1 process x
    micro-batch 4."""
    single = tmp_path / "single"
    sharded = tmp_path / "fsdp"
    tune(tiny, single, "--steps", "3", "--micro-batch", "4")
    run = two_processes(tiny, sharded, "--steps", "3", "--micro-batch", "1")
    assert "2 process(es)" in run.stdout
    a = weights(single / "final")
    b = weights(sharded / "final")
    base = weights(tiny / "base")
    # It did train.
    change = max((a[n][:100] - base[n][:100]).abs().max()
                 for n in base)
    assert change > 1e-4
    for n in a:
        torch.testing.assert_close(a[n], b[n],
                                   atol=2e-6, rtol=1e-5)


def test_fsdp2_teacher_gives_back_its_gathered_root_after_each_forward(tiny, tmp_path):
    """The frozen teacher runs no backward, so FSDP2 must reshard its root (the embedding
    and the output layer, about 2 GB for an 8B model) right after its forward, or every
    rank keeps them whole for the run. One process in a gloo group of one is enough to see
    it."""
    from torch.distributed.tensor import DTensor

    store = f"file://{tmp_path / 'store'}"
    torch.distributed.init_process_group("gloo", init_method=store,
                                         rank=0, world_size=1)
    try:
        dist = F.Dist(rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32,
                      sharded=True)
        args = argparse.Namespace(model=str(tiny / "base"))
        _, teacher, _, _ = F.load_student_and_teacher(args, dist)
        with torch.no_grad():
            teacher(torch.zeros(1, 4, dtype=torch.long))
        # Sharded again, not held whole.
        assert isinstance(teacher.tok_emb.weight, DTensor)
        assert isinstance(teacher.layers[0].attn.wq.weight, DTensor)
    finally:
        torch.distributed.destroy_process_group()


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
    ours = from_pretrained(out / "final")
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
    assert torch.equal(seqs, F.training_sequences(pairs[:1] * 3, tok, "plain", 96)[0].long())
    # every token but <bos> is supervised, up to the first <eos>
    end = int((seqs[0] == tok.eos_id).nonzero()[0])
    assert supervised[0, 1:end + 1].all()
    assert supervised[0].sum() == end
    tuned = str(tmp_path / "tuned")
    args = ["train", "--model", out["base"], "--data", out["train"], "--out", tuned]
    assert F.main([*args, *TRAIN, "--steps", "1"]) == 0


def test_gt_mode_and_activation_checkpointing(tiny, tmp_path):
    """The naive ground-truth ablation trains, with activations recomputed in backward."""
    gt = tmp_path / "gt"
    tune(tiny, gt, "--steps", "2", "--mode", "gt", "--activation-checkpointing")
    assert "the naive ground-truth" in (gt / "final" / "README.md").read_text()


def test_gated_adapter_trains_only_itself_resumes_exactly_and_exports_a_small_folder(
        tiny, tmp_path, capsys, monkeypatch):
    """--adapter gated-lora: the optimizer holds the adapter and the <mask> embedding only,
    the base folder stays as it was, a resumed run equals an uninterrupted one, checkpoints
    hold no base weight, and final/ (and export) hold the adapter, which every loader reads
    with its base."""
    from adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    before = weights(tiny / "base")
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--adapter-alpha", "8"]
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    tune(tiny, full, "--steps", "4", *adapter)
    final = full / "final"
    files = sorted(p.name for p in final.iterdir())
    assert files == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md"])
    saved = load_file(str(final / ADAPTER_WEIGHTS))
    assert all(".adapter." in n or n == "mask_embedding" for n in saved)
    # It did train.
    ups = [t for n, t in saved.items() if n.endswith(".up")]
    assert max(t.abs().max() for t in ups) > 0
    base_after = weights(tiny / "base")
    assert same(before, base_after)

    # No base weight in a checkpoint.
    step_4 = full / "checkpoints" / "step_000004"
    ckpt_bytes = sum(f.stat().st_size
                     for f in step_4.rglob("*") if f.is_file())
    base_bytes = (tiny / "base" / "model.safetensors").stat().st_size
    assert ckpt_bytes < base_bytes
    card = (final / "README.md").read_text()
    assert "not a LoRA" in card
    assert F.MODEL_CARD_TAGS in card

    real = F.train_step
    steps = []

    def crash_after_3(*a, **kw):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(F, "train_step", crash_after_3)
    argv = train_args(tiny, cut, "--steps", "4", *adapter)
    assert F.main(argv) != 0
    monkeypatch.setattr(F, "train_step", real)
    # Another rank.
    argv = train_args(tiny, cut, "--steps", "4", *adapter[:2], "--resume")
    assert F.main(argv) == 2
    assert "--adapter-rank 4 -> 32" in capsys.readouterr().err
    tune(tiny, cut, "--steps", "4", *adapter, "--resume")
    resumed = load_file(str(cut / "final" / ADAPTER_WEIGHTS))
    assert saved.keys() == resumed.keys()
    assert same(saved, resumed)
    export(full, tmp_path / "exp")
    exported = load_file(str(tmp_path / "exp" / ADAPTER_WEIGHTS))
    assert same(saved, exported)

    # eval reads base + adapter; its greedy answers are the untuned model's, word for word.
    common = ["eval", "--data", str(tiny / "wp" / "test.jsonl"),
              "--prompt-style", "zeroshot", "--max-new-tokens", "8", "--batch-size", "2",
              "--static-k", "1", "--taus"]
    argv = common + ["--model", str(tiny / "base"), "--out", str(tmp_path / "e0")]
    assert F.main(argv) == 0
    argv = common + ["--model", str(final), "--out", str(tmp_path / "e1"), "--lossless-k", "3"]
    assert F.main(argv) == 0
    answers = [[r["completion"] for r in jsonl(tmp_path / e / "samples.jsonl")]
               for e in ("e0", "e1")]
    greedy = answers[0]
    assert answers[1][: len(greedy)] == greedy
    assert answers[1][len(greedy):] == greedy


def test_gated_adapter_refuses_the_prefix_loss_and_an_adapter_as_base(tiny, tmp_path, capsys):
    """The prefix loss cannot train a gated adapter, and an adapter folder is no base
    model: one error line each."""
    run = tmp_path / "run"
    argv = train_args(tiny, run, "--adapter", "gated-lora", "--prefix-ntp-weight", "1")
    assert F.main(argv) == 2
    assert "cannot change" in capsys.readouterr().err
    tune(tiny, run, "--steps", "1", "--adapter", "gated-lora")
    again = train_args(tiny, tmp_path / "again", "--adapter", "gated-lora",
                       model=run / "final")
    assert F.main(again) == 2
    err = capsys.readouterr().err.strip()
    assert "is a gated mask adapter" in err
    assert "\n" not in err


def test_gated_adapter_under_fsdp2_on_two_cpu_processes_matches_one_process(tiny, tmp_path):
    """The adapter sharded over 2 processes x micro-batch 1 trains what 1 process x
    micro-batch 4 does."""
    from adapter import ADAPTER_WEIGHTS
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "3"]
    single = tmp_path / "single"
    sharded = tmp_path / "fsdp"
    tune(tiny, single, *adapter, "--micro-batch", "4")
    two_processes(tiny, sharded, *adapter, "--micro-batch", "1")
    a = load_file(str(single / "final" / ADAPTER_WEIGHTS))
    b = load_file(str(sharded / "final" / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n],
                                   atol=2e-6, rtol=1e-5)


def test_gated_adapter_under_fsdp2_in_bfloat16(tiny, tmp_path):
    """FSDP2's mixed precision for real: float32 shards, a bfloat16 computation. The
    adapter's step reads its KV cache (built from the float32 shards) in bfloat16."""
    out = tmp_path / "fsdp_bf16"
    two_processes(tiny, out, "--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "2",
                  "--micro-batch", "1", "--dtype", "bfloat16")
    assert (out / "final" / "mask_adapter.safetensors").is_file()


# ---------------------------------------------------------------------------------------
# eval and analyze end to end, and bad input
# ---------------------------------------------------------------------------------------

def test_eval_sweep_writes_table_and_plot(tiny, tmp_path):
    """One sweep over greedy, static k, ConfAdapt and lossless writes results, samples,
    table and plot; lossless is as accurate as greedy."""
    model = tmp_path / "m"
    tune(tiny, model, "--steps", "1")
    out = tmp_path / "eval"
    common = ["eval", "--model", str(model / "final"),
              "--data", str(tiny / "wp" / "test.jsonl"), "--out", str(out),
              "--max-new-tokens", "6", "--batch-size", "2"]
    sweep = ["--prompt-style", "zeroshot",
             "--static-k", "1", "3", "--taus", "0.9", "--lossless-k", "4"]
    assert F.main(common + sweep) == 0
    results = json_file(out / "results.json")
    meta = results["meta"]
    res = results["results"]
    # Provenance: no commit outside git.
    assert meta["commit"] is None or re.fullmatch("[0-9a-f]{40}", meta["commit"])
    assert meta["cpu"]
    assert meta["dtype"] in ("float32", "bfloat16")
    assert meta["torch"] == torch.__version__
    # The gold answer: after '####'.
    assert jsonl(out / "samples.jsonl")[0]["gold"].isdigit()
    decoders = ["k=1 (greedy)", "static k=3", "confadapt tau=0.9 k_max=16", "lossless k=4"]
    assert [r["decoding"] for r in res] == decoders
    assert res[0]["effective_k_mean"] == 1.0
    assert res[1]["effective_k_mean"] > 1.0
    # Lossless equals greedy.
    assert res[3]["flexible_acc"] == res[0]["flexible_acc"]
    assert "| static k=3 |" in (out / "results.md").read_text()
    assert (out / "pareto.png").stat().st_size > 0

    # An 8-shot prompt, into an --out that holds an earlier eval.
    again = common + ["--limit", "1", "--static-k", "1", "--taus"]
    assert F.main(again) == 2
    assert F.main(again + ["--overwrite"]) == 0


def test_analyze_estimates(tiny, tmp_path):
    """simulated_passes on hand-made confidences, then analyze on a file and on domains."""
    # ConfAdapt simulated on hand-made confidences: [0.5] [.95 .95] [0.5], as a pass
    # stops at an unsure token, as ConfAdapt does.
    conf = [0.5, 0.95, 0.95, 0.5]
    assert F.simulated_passes(conf, 0.9, 16, joint=False) == 3
    assert F.simulated_passes(conf, 0.9, 16, joint=True) == 3
    # [.95 .95 .95 .95]
    assert F.simulated_passes([0.95] * 4, 0.9, 16, joint=False) == 1
    # [.95 .95] [.95 .95]: .95^3 < 0.9
    assert F.simulated_passes([0.95] * 4, 0.9, 16, joint=True) == 2
    # k_max caps a pass.
    assert F.simulated_passes([1.0] * 10, 0.9, 4, joint=True) == 3

    out = tmp_path / "an"
    argv = ["analyze", "--model", str(tiny / "base"),
            "--data", str(tiny / "wp" / "test.jsonl"),
            "--limit", "2", "--max-new-tokens", "4", "--taus", "0.9",
            "--out", str(out)]
    assert F.main(argv) == 0
    report = json_file(out / "analysis.json")["domains"]["test.jsonl"]
    assert report["tokens"] > 0
    assert report["estimates"][0]["effective_k_per_token"] >= 1.0

    # --out holds an earlier analysis.
    again = ["analyze", "--model", str(tiny / "base"),
             "--domains", "lists", "word_problems",
             "--limit", "2", "--max-new-tokens", "4", "--taus", "0.9", "0.5",
             "--out", str(out)]
    assert F.main(again) == 2
    assert F.main(again + ["--overwrite"]) == 0
    report = json_file(out / "analysis.json")["domains"]
    assert list(report) == ["lists", "word_problems"]
    assert len(report["lists"]["estimates"]) == 2
    assert "| lists | 2 |" in (out / "analysis.md").read_text()


def test_data_writes_the_models_own_answers_and_train_reads_them(tiny, tmp_path):
    """`data` writes the model's own answers as rows, which `train` reads beside another
    file."""
    rows_file = tmp_path / "own.jsonl"
    argv = ["data", "--model", str(tiny / "base"), "--out", str(rows_file),
            "--domains", "lists", "writing",
            "--per-domain", "3", "--max-new-tokens", "5"]
    assert F.main(argv) == 0
    rows = jsonl(rows_file)
    assert [r["domain"] for r in rows] == ["lists"] * 3 + ["writing"] * 3
    assert rows[0]["prompt"] in domain_prompts("lists", 3)
    assert all(isinstance(r["response"], str) for r in rows)

    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny / "base"),
            "--data", str(rows_file), str(tiny / "wp" / "train.json"),
            "--out", str(out), *TRAIN,
            "--steps", "2", "--prefix-ntp-weight", "0.5"]
    assert F.main(argv) == 0
    assert json_file(out / "train_args.json")["prefix_ntp_weight"] == 0.5
    log = jsonl(out / "log.jsonl")
    assert len(log) == 2
    assert all(r["loss"] == r["loss"] for r in log)


def test_response_only_supervises_the_response_and_not_the_prompt(tiny, tmp_path):
    """--response-only: only the response is a target, so the same steps predict fewer,
    but some, tokens."""
    tok = Tokenizer.from_pretrained(tiny / "base")
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
        tune(tiny, out, "--steps", "3", *flag)
        n_pred[bool(flag)] = [r["n_pred"] for r in jsonl(out / "log.jsonl")]
    assert len(n_pred[True]) == 3
    # Per step: some, and fewer than without --response-only.
    pairs = zip(n_pred[True], n_pred[False])
    assert all(0 < r < a for r, a in pairs)
    card = (tmp_path / "response" / "final" / "README.md").read_text()
    assert "targets in the responses only" in card


def test_decay_takes_the_learning_rate_linearly_to_zero_over_the_last_steps(tiny, tmp_path):
    out = tmp_path / "decay"
    tune(tiny, out, "--steps", "6", "--warmup", "1", "--decay", "4")
    lrs = [r["lr"] for r in jsonl(out / "log.jsonl")]
    # The log's lr is the rate the step trained at: step s runs at min(1, (6 - s) / 4) of
    # the peak for s = 0..5, so 1, 1, 1, 0.75, 0.5, 0.25.
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert "then linear to 0 over the last 4," in (out / "final" / "README.md").read_text()


def test_bfloat16_training_on_cpu(tiny, tmp_path):
    """bfloat16 autocast on the CPU trains, with finite losses."""
    out = tmp_path / "bf16"
    tune(tiny, out, "--steps", "2", "--dtype", "bfloat16")
    log = jsonl(out / "log.jsonl")
    assert len(log) == 2
    assert all(math.isfinite(r["loss"]) for r in log)


def test_auto_compute_dtype_on_a_gpu_that_only_emulates_bfloat16(monkeypatch):
    """A T4 or V100 says yes to torch.cuda.is_bf16_supported() counting emulation: float32
    there."""
    def t4(including_emulation=True):
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", t4)
    assert F.compute_dtype("cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: True)
    assert F.compute_dtype("cuda") == torch.bfloat16


def test_bad_input_gives_one_error_line(tiny, tmp_path, capsys):
    """Bad rows, a folder without a tokenizer, a missing file, an unknown or absent
    device, a model without <mask>: exit code 2 and one error line each."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n')
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / "base" / f, no_tok / f)
    base = str(tiny / "base")
    train = str(tiny / "wp" / "train.json")
    test = str(tiny / "wp" / "test.jsonl")
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
        assert F.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and expected in err, err
