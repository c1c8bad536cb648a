"""mtp/distributed.py: FSDP2's sharding of the frozen teacher, the checkpoint `latest` names,
and the settings a resumed run must keep. Training under torchrun end to end, on two CPU
processes, is in test_finetune_hf.py."""
import argparse

import pytest
import torch

import finetune_hf
from mtp.distributed import Dist, check_same_run, latest_checkpoint

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def test_fsdp2_teacher_gives_back_its_gathered_root_after_each_forward(tiny_hf, tmp_path):
    """The frozen teacher runs no backward, so FSDP2 must reshard its root (the embedding
    and the output layer, about 2 GB for an 8B model) right after its forward, or every
    rank keeps them whole for the run. One process in a gloo group of one is enough to see
    it."""
    from torch.distributed.tensor import DTensor

    store = f"file://{tmp_path / 'store'}"
    torch.distributed.init_process_group("gloo", init_method=store,
                                         rank=0, world_size=1)
    try:
        dist = Dist(rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32,
                    sharded=True)
        args = argparse.Namespace(model=str(tiny_hf / "base"))
        _, teacher, _, _ = finetune_hf.load_student_and_teacher(args, dist)
        with torch.no_grad():
            teacher(torch.zeros(1, 4, dtype=torch.long))
        # Sharded again, not held whole.
        assert isinstance(teacher.tok_emb.weight, DTensor)
        assert isinstance(teacher.layers[0].attn.wq.weight, DTensor)
    finally:
        torch.distributed.destroy_process_group()


def test_latest_checkpoint_is_the_one_named_and_only_when_whole(tmp_path):
    """checkpoints/latest names the last checkpoint; one without its trainer.pt (a save
    that died) is none."""
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) is None
    (root / "step_000002").mkdir(parents=True)
    (root / "latest").write_text("step_000002\n")
    assert latest_checkpoint(tmp_path) is None
    (root / "step_000002" / "trainer.pt").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == root / "step_000002"


def test_a_resume_keeps_the_settings_of_its_run(tmp_path, monkeypatch):
    """Every setting that shapes the run must match, paths by what they name; arguments
    that do not name --adapter (as a checkpoint's may not) train no adapter."""
    monkeypatch.chdir(tmp_path)
    run = {"model": "base", "data": ["wp/train.json"], "lr": 1e-5, "seed": 0}
    same = {**run, "model": str(tmp_path / "base"), "adapter": "none", "steps": 9}
    check_same_run(run, same, "ckpt")
    with pytest.raises(ValueError, match=r"--lr 1e-05 -> 0.001; --seed 0 -> 1\)"):
        check_same_run(run, {**same, "lr": 1e-3, "seed": 1}, "ckpt")
    with pytest.raises(ValueError, match="--adapter none -> gated-lora"):
        check_same_run(run, {**same, "adapter": "gated-lora"}, "ckpt")
    adapter = {**same, "adapter": "gated-lora", "adapter_rank": 4, "adapter_alpha": 8.0,
               "adapter_targets": ["wq"]}
    check_same_run(adapter, adapter, "ckpt")
    with pytest.raises(ValueError, match="--adapter-rank 4 -> 32"):
        check_same_run(adapter, {**adapter, "adapter_rank": 32}, "ckpt")
