"""finetune_hf.py on tiny Hugging Face checkpoints (conftest's tiny_hf, written by
transformers itself): training, exact resume, FSDP2 on two CPU processes, the gated mask
adapter, export to transformers, bad input. Expensive runs are made once per file, in
module-scoped fixtures, and checked claim by claim.
"""
import contextlib
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import finetune_hf
from conftest import run_script
from mtp.cli import read_rows
from mtp.finetune_cli import MODEL_CARD_TAGS, build_parser
from mtp.tokenizer import (QWEN2_PATTERN, Tokenizer, prompt_tokens, response_tokens,
                           training_sequences)
from tasks.word_problems import word_problem_batch, word_problem_tokenizer, write_word_problems
from mtp.hf import from_pretrained

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


# ---------------------------------------------------------------------------------------
# Training: atomic checkpoints, exact resume, FSDP2, export
# ---------------------------------------------------------------------------------------

def test_data_order_is_a_function_of_the_step_and_each_epoch_a_permutation():
    a = [finetune_hf.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    again = [finetune_hf.rows_of_step(s, 4, 10, seed=1) for s in range(5)]
    assert a == again
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:20]) == list(range(10))


def printed_by(body) -> tuple:
    """(what body() returns, what it prints on stdout and stderr): module-scoped
    fixtures have no capsys."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        result = body()
    return result, printed.getvalue()


def crash_at_call(n: int, error):
    """finetune_hf.train_step, except that its n-th call raises `error`: within
    pytest.MonkeyPatch.context(), a run stopped part-way."""
    real = finetune_hf.train_step
    calls = []

    def train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)
    return train_step


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def full_run(one_thread_for_module, tiny_hf, tmp_path_factory):
    """A 5-step run, uninterrupted: (its --out, what it printed)."""
    out = tmp_path_factory.mktemp("full") / "run"
    _, printed = printed_by(lambda: tune(tiny_hf, out, "--steps", "5"))
    return out, printed


@pytest.fixture(scope="module")
def resumed_run(one_thread_for_module, tiny_hf, tmp_path_factory):
    """The same run stopped after step 3 (its last checkpoint: step 2), with a save that
    died halfway left behind, then resumed: (its --out, the checkpoint `latest` named when
    it stopped, what the resume printed)."""
    out = tmp_path_factory.mktemp("cut") / "run"
    args = build_parser().parse_args(train_args(tiny_hf, out, "--steps", "5"))
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(finetune_hf, "train_step", crash_at_call(4, Interrupted))
        # As `finetune_hf.py train` does (mtp.finetune_cli.run_command).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with pytest.raises(Interrupted):
            printed_by(lambda: finetune_hf.train(args))
    latest = (out / "checkpoints" / "latest").read_text().strip()
    (out / "checkpoints" / ".step_000004.tmp").mkdir()
    _, printed = printed_by(lambda: tune(tiny_hf, out, "--steps", "5", "--resume"))
    return out, latest, printed


def test_train_logs_loss_speed_and_eta(full_run):
    _, printed = full_run
    assert "step 5/5 | loss" in printed
    assert "tok/s | ETA" in printed


def test_a_stopped_run_keeps_its_last_whole_checkpoint(resumed_run):
    """Stopped during step 4 (checkpoints every 2 steps): `latest` names step 2."""
    _, latest, _ = resumed_run
    assert latest == "step_000002"


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(full_run, resumed_run):
    """Resumed from step 2, past a save that died halfway, it ends with the same weights."""
    full, _ = full_run
    cut, _, printed = resumed_run
    assert "resumed from" in printed
    a = weights(full / "final")
    b = weights(cut / "final")
    assert a.keys() == b.keys()
    assert same(a, b)


def test_a_run_keeps_its_last_keep_checkpoints(resumed_run):
    """--keep 2 (the default): the dead save's folder and the older checkpoints go."""
    cut, _, _ = resumed_run
    kept = sorted(p.name for p in (cut / "checkpoints").glob("*step_*"))
    assert kept == ["step_000004", "step_000005"]


def test_the_export_loads_in_transformers_with_mask_and_gives_our_logits(full_run):
    """<mask> in tokenizer and config, one row past the tokenizer's vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = full_run[0] / "final"
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


def test_the_model_card_says_how_to_decode_naming_only_files_the_repository_has(full_run):
    card = (full_run[0] / "final" / "README.md").read_text()
    assert "confadapt.py --model" in card
    assert "METHOD" not in card
    names = re.findall(r"[\w/]+\.py\b", card)
    assert all((REPO / f).is_file() for f in names)


def test_export_rebuilds_the_same_folder_from_the_last_checkpoint(full_run, tmp_path):
    full, _ = full_run
    export(full, tmp_path / "exp")
    assert same(weights(full / "final"), weights(tmp_path / "exp"))


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


def test_a_torchrun_worker_ends_with_its_commands_exit_status(tiny_hf, tmp_path):
    """Under torchrun a worker leaves as soon as its command ends (mtp.distributed.end_worker),
    with the command's status: a missing --data file is one `error:` line and status 2, which
    torchrun reports as the worker's failure."""
    args = train_args(tiny_hf, tmp_path / "run", "--steps", "1")
    args[args.index("--data") + 1] = str(tmp_path / "missing.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(REPO / "finetune_hf.py"), *args]
    run = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=300, capture_output=True, text=True)
    assert run.returncode != 0
    assert f"error: --data {tmp_path / 'missing.json'}: no such file" in run.stderr
    assert "(exitcode: 2)" in run.stderr


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
    wp = ["--out", str(tmp_path / "wp"), "--quick"]
    # a run, then a second one into the same folder
    done, again = run_script(REPO / "scripts" / "word_problem_base.py", wp, wp)
    assert done.returncode == 0, done.stderr
    assert again.returncode == 2
    assert re.search("base exists: .* add --restart", again.stderr)
    # the folders its docstring names
    base, train = tmp_path / "wp" / "base", tmp_path / "wp" / "data" / "train.json"
    out = {"base": str(base), "train": str(train)}
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


ADAPTER = ["--adapter", "gated-lora", "--adapter-rank", "4", "--adapter-alpha", "8"]


@pytest.fixture(scope="module")
def adapter_run(one_thread_for_module, tiny_hf, tmp_path_factory):
    """A 4-step --adapter gated-lora run: (its --out, the base folder's weights before it)."""
    before = weights(tiny_hf / "base")
    out = tmp_path_factory.mktemp("adapter") / "run"
    printed_by(lambda: tune(tiny_hf, out, "--steps", "4", *ADAPTER))
    return out, before


@pytest.fixture(scope="module")
def adapter_resumed(one_thread_for_module, tiny_hf, tmp_path_factory):
    """The same run stopped by Ctrl-C in step 4, then resumed with another rank (refused)
    and with its own: (its --out, what the refused resume printed)."""
    out = tmp_path_factory.mktemp("adapter_cut") / "run"
    argv = train_args(tiny_hf, out, "--steps", "4", *ADAPTER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune_hf, "train_step", crash_at_call(4, KeyboardInterrupt))
        status, _ = printed_by(lambda: finetune_hf.main(argv))
    assert status != 0
    other_rank = train_args(tiny_hf, out, "--steps", "4", *ADAPTER[:2], "--resume")
    status, refused = printed_by(lambda: finetune_hf.main(other_rank))
    assert status == 2
    printed_by(lambda: tune(tiny_hf, out, "--steps", "4", *ADAPTER, "--resume"))
    return out, refused


def test_gated_adapter_final_holds_the_trained_adapter_alone(adapter_run):
    """final/ holds the adapter's config and weights, a card and what it trained with: the
    low-rank updates and the <mask> embedding, which training changed."""
    from adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    final = adapter_run[0] / "final"
    files = sorted(p.name for p in final.iterdir())
    assert files == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md", "trained_with.json"])
    saved = load_file(str(final / ADAPTER_WEIGHTS))
    assert all(".adapter." in n or n == "mask_embedding" for n in saved)
    ups = [t for n, t in saved.items() if n.endswith(".up")]
    assert max(t.abs().max() for t in ups) > 0


def test_gated_adapter_leaves_the_base_folder_as_it_was(adapter_run, tiny_hf):
    _, before = adapter_run
    assert same(before, weights(tiny_hf / "base"))


def test_gated_adapter_checkpoints_hold_no_base_weight(adapter_run, tiny_hf):
    """The optimizer holds the adapter and the <mask> embedding only, and so does a
    checkpoint: smaller than the base model's weights."""
    step_4 = adapter_run[0] / "checkpoints" / "step_000004"
    ckpt_bytes = sum(f.stat().st_size
                     for f in step_4.rglob("*") if f.is_file())
    base_bytes = (tiny_hf / "base" / "model.safetensors").stat().st_size
    assert ckpt_bytes < base_bytes


def test_gated_adapter_card_says_it_is_no_lora(adapter_run):
    card = (adapter_run[0] / "final" / "README.md").read_text()
    assert "not a LoRA" in card
    assert MODEL_CARD_TAGS in card


def test_gated_adapter_resumes_only_with_its_own_settings(adapter_resumed):
    _, refused = adapter_resumed
    assert "--adapter-rank 4 -> 32" in refused


def test_gated_adapter_resumed_equals_uninterrupted(adapter_run, adapter_resumed):
    from adapter import ADAPTER_WEIGHTS
    saved = load_file(str(adapter_run[0] / "final" / ADAPTER_WEIGHTS))
    resumed = load_file(str(adapter_resumed[0] / "final" / ADAPTER_WEIGHTS))
    assert saved.keys() == resumed.keys()
    assert same(saved, resumed)


def test_gated_adapter_export_writes_the_adapter_again(adapter_run, tmp_path):
    from adapter import ADAPTER_WEIGHTS
    full, _ = adapter_run
    export(full, tmp_path / "exp")
    saved = load_file(str(full / "final" / ADAPTER_WEIGHTS))
    exported = load_file(str(tmp_path / "exp" / ADAPTER_WEIGHTS))
    assert same(saved, exported)


def test_an_adapter_checkpoint_from_before_slot_embeddings_exports(adapter_run, tmp_path):
    """A run saved before --adapter-slot-embeddings existed has no such argument: it trained
    one shared <mask>, and exports as such."""
    from adapter import ADAPTER_CONFIG
    run = tmp_path / "old"
    shutil.copytree(adapter_run[0], run)
    step = run / "checkpoints" / "step_000004"
    trainer = torch.load(step / "trainer.pt", weights_only=True)
    del trainer["args"]["adapter_slot_embeddings"]
    torch.save(trainer, step / "trainer.pt")
    export(step, tmp_path / "exp")
    assert json_file(tmp_path / "exp" / ADAPTER_CONFIG)["mask_slots"] == 0


def test_gated_adapter_answers_as_the_untuned_model_word_for_word(adapter_run, tiny_hf,
                                                                   tmp_path):
    """eval reads base + adapter; its greedy answers, and its lossless ones, are the
    untuned model's."""
    common = ["eval", "--data", str(tiny_hf / "wp" / "test.jsonl"),
              "--prompt-style", "zeroshot", "--max-new-tokens", "8", "--batch-size", "2",
              "--static-k", "1", "--taus"]
    argv = common + ["--model", str(tiny_hf / "base"), "--out", str(tmp_path / "e0")]
    assert finetune_hf.main(argv) == 0
    final = adapter_run[0] / "final"
    argv = common + ["--model", str(final), "--out", str(tmp_path / "e1"), "--lossless-k", "3"]
    assert finetune_hf.main(argv) == 0
    answers = [[r["completion"] for r in jsonl(tmp_path / e / "samples.jsonl")]
               for e in ("e0", "e1")]
    greedy = answers[0]
    assert answers[1][: len(greedy)] == greedy
    assert answers[1][len(greedy):] == greedy


def test_slot_embeddings_train_save_and_refuse_more_slots_than_trained(one_thread, tiny_hf,
                                                                        tmp_path, capsys):
    """--adapter-slot-embeddings: k_max - 1 <mask> embeddings, each trained, saved with the
    adapter; decoding with a larger k_max is refused in one line; resuming without the flag is
    another run."""
    from adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    out = tmp_path / "slots"
    slots = [*ADAPTER, "--k-max", "3", "--adapter-slot-embeddings"]
    tune(tiny_hf, out, "--steps", "2", *slots)
    final = out / "final"
    assert json_file(final / ADAPTER_CONFIG)["mask_slots"] == 2
    embedding = load_file(str(final / ADAPTER_WEIGHTS))["mask_embedding"]
    assert embedding.shape[0] == 2
    assert not torch.equal(embedding[0], embedding[1])
    common = ["eval", "--model", str(final), "--data", str(tiny_hf / "wp" / "test.jsonl"),
              "--prompt-style", "zeroshot", "--max-new-tokens", "4", "--limit", "2",
              "--static-k", "1", "--taus", "0.5"]
    assert finetune_hf.main(common + ["--k-max", "3", "--out", str(tmp_path / "e3")]) == 0
    capsys.readouterr()
    assert finetune_hf.main(common + ["--k-max", "4", "--out", str(tmp_path / "e4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "error" in line] == [
        "error: this adapter was trained with 2 <mask> slots: decode with k_max at most 3, "
        "not 4"]
    shared = train_args(tiny_hf, out, "--steps", "3", *slots[:-1], "--resume")
    assert finetune_hf.main(shared) == 2
    assert "--adapter-slot-embeddings True -> False" in capsys.readouterr().err


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


@pytest.mark.parametrize("shard_base", ["yes", "no"])
def test_gated_adapter_under_fsdp2_on_two_cpu_processes_matches_one_process(tiny_hf, tmp_path,
                                                                            shard_base):
    """The adapter on 2 processes x micro-batch 1, its base sharded (FSDP2) or whole on each,
    trains what 1 process x micro-batch 4 does, checkpoints and export included."""
    from adapter import ADAPTER_WEIGHTS
    adapter = ["--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "3"]
    single = tmp_path / "single"
    sharded = tmp_path / "fsdp"
    tune(tiny_hf, single, *adapter, "--micro-batch", "4")
    two_processes(tiny_hf, sharded, *adapter, "--micro-batch", "1", "--shard-base", shard_base)
    a = load_file(str(single / "final" / ADAPTER_WEIGHTS))
    b = load_file(str(sharded / "final" / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n],
                                   atol=2e-6, rtol=1e-5)


def test_gated_adapter_under_fsdp2_in_bfloat16(tiny_hf, tmp_path):
    """FSDP2's mixed precision for real: bfloat16 shards of the frozen base beside float32
    ones of the adapter, a bfloat16 computation."""
    out = tmp_path / "fsdp_bf16"
    two_processes(tiny_hf, out, "--adapter", "gated-lora", "--adapter-rank", "4", "--steps", "2",
                  "--micro-batch", "1", "--dtype", "bfloat16", "--shard-base", "yes")
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
