"""mtp/memory.py, the figures of benchmarks/memory.py: they are computed on the meta device, so
they are checked on a tiny model against real tensors: the activation count against the same count
on CPU tensors under torch.autocast, the training state against the bytes of a student built by
finetune_hf itself. The benchmark's command lines run as a user runs them (conftest.run_script)."""
import argparse
import shutil
from pathlib import Path

import pytest
import torch

import finetune_hf
from adapter import ADAPTER_TARGETS, gated_mtp_loss
from conftest import run_script
from data import mtp_layout
from distill import mtp_loss
from model import ModelConfig, Transformer
from mtp import memory
from mtp.distributed import Dist
from mtp.hf import save_pretrained
from tasks.word_problems import word_problem_tokenizer

MEMORY_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py"

pytestmark = pytest.mark.usefixtures("one_thread")            # conftest.py

STEP = memory.Step(seq_len=40, micro_batch=3, k=4, regions=5)
RANK = 4


def tiny_config(vocab_size=64, tied=False) -> ModelConfig:
    """Grouped-query attention (4 heads, 2 KV heads), as both real models have."""
    return ModelConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=48, max_seq_len=128, tie_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", memory.MODES)
def test_the_meta_count_equals_the_count_on_cpu_tensors(mode, tied):
    """Exactly: the same saved tensors, byte for byte. Without memory.Autocast the full fine-tune's
    weight copies would be missing; without memory.FusedAttention meta would save float32 scores."""
    cfg = memory.with_mask(tiny_config(tied=tied))
    on_meta = memory.activation_bytes(cfg, mode, STEP, RANK, device="meta")
    on_cpu = memory.activation_bytes(cfg, mode, STEP, RANK, device="cpu")
    assert on_meta == on_cpu > 0


def storage_bytes(tensors) -> int:
    """The bytes of the memory the tensors occupy, a storage shared by several counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values())


@pytest.mark.parametrize("mode", memory.MODES)
def test_the_training_state_is_the_bytes_of_a_student_built_by_finetune_hf(mode, tmp_path):
    """finetune_hf builds student and teacher from a checkpoint (adding <mask>) and takes one step;
    the weights, the teacher, the gradients and AdamW's two moments (not its step counters, a
    scalar each) then hold exactly the bytes the table gives for the same config on meta."""
    tok = word_problem_tokenizer()
    cfg = tiny_config(vocab_size=tok.n_vocab)
    save_pretrained(Transformer(cfg), tmp_path)
    tok.save_pretrained(tmp_path)
    adapter = "none" if mode == "full" else "gated-lora"
    args = argparse.Namespace(model=str(tmp_path), adapter=adapter, adapter_rank=RANK,
                              adapter_alpha=memory.ALPHA, adapter_targets=list(ADAPTER_TARGETS),
                              adapter_slot_embeddings=False)
    d = Dist(dtype=memory.COMPUTE)
    student, teacher, _, mask_id = finetune_hf.load_student_and_teacher(args, d)
    optimizer = student.configure_optimizer(lr=1e-3, weight_decay=0.0)
    seqs = torch.randint(0, tok.n_vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = mtp_layout(seqs, 4, 0, 5, mask_id)
    with torch.autocast("cpu", dtype=memory.COMPUTE):
        if teacher is None:
            # the gated adapter's teacher is the student with its adapter off
            loss, _ = gated_mtp_loss(student, batch)
        else:
            loss, _ = mtp_loss(student, teacher, batch)
    loss.backward()
    optimizer.step()
    trained = [p for p in student.parameters() if p.requires_grad]
    moments = [optimizer.state[p][m] for p in trained for m in ("exp_avg", "exp_avg_sq")]
    copy = isinstance(teacher, torch.nn.Module)      # else the student with its adapter off
    real = {"weights": storage_bytes(student.parameters()),
            "teacher": storage_bytes(teacher.parameters()) if copy else 0,
            "gradients": storage_bytes(p.grad for p in trained), "AdamW": storage_bytes(moments)}
    computed = memory.figures(memory.with_mask(cfg), mode, STEP, RANK)
    assert {name: computed[name] for name in real} == real
    assert (real["teacher"] > 0) == (mode == "full")


def test_command_line(tmp_path):
    out, notes = tmp_path / "memory", tmp_path / "notes"
    smollm2 = ["--models", "smollm2-135m", "--out", str(out)]
    lines = [smollm2, ["--models", "gpt-5"], ["--k", "1"]]
    done, unknown_model, k_of_one = run_script(MEMORY_PY, *lines, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "| smollm2-135m | adapter |" in done.stdout
    assert "not measured on a GPU" in (out / "memory.md").read_text()
    assert unknown_model.returncode == 2
    errors = k_of_one.stderr.splitlines()
    assert k_of_one.returncode == 2
    assert len(errors) == 1 and errors[0].startswith("error: argument --k")
    # a copy of the output, its table replaced by someone else's notes
    shutil.copytree(out, notes)
    (notes / "memory.md").write_text("someone else's notes\n")
    onto_notes = ["--models", "smollm2-135m", "--out", str(notes), "--overwrite"]
    lines = [smollm2, [*smollm2, "--overwrite"], onto_notes]
    again, overwritten, over_notes = run_script(MEMORY_PY, *lines, cwd=tmp_path)
    # needs --overwrite
    assert again.returncode == 2
    assert overwritten.returncode == 0, overwritten.stderr
    assert over_notes.returncode == 2
    assert (notes / "memory.md").read_text() == "someone else's notes\n"
