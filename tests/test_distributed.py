"""mtp/distributed.py: FSDP2's sharding of the frozen teacher, the gated adapter's step on two
gloo processes (its base sharded or whole on each), the checkpoint `latest` names, and the
settings a resumed run must keep. Training under torchrun end to end, on two CPU processes, is in
test_finetune_hf.py."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import finetune_hf
from data import mtp_layout
from distributed_step import EOS, K, OFFSET, micro_batches, one_step
from mtp.distributed import Dist, check_same_run, latest_checkpoint
from mtp.engine import HostSyncs

STEP = Path(__file__).resolve().parent / "distributed_step.py"

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
                    group=True, sharded=True)
        args = argparse.Namespace(model=str(tiny_hf / "base"))
        _, teacher, _, _ = finetune_hf.load_student_and_teacher(args, dist)
        with torch.no_grad():
            teacher(torch.zeros(1, 4, dtype=torch.long))
        # Sharded again, not held whole.
        assert isinstance(teacher.tok_emb.weight, DTensor)
        assert isinstance(teacher.layers[0].attn.wq.weight, DTensor)
    finally:
        torch.distributed.destroy_process_group()


def two_processes(model, out, shard_base, dtype) -> list[dict]:
    """distributed_step.py on two gloo processes -> each one's result. Its process group gives
    up after two minutes, and so does this test: a hang fails, it does not stall the suite."""
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(STEP), str(model), str(out), shard_base, dtype]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]


def is_adapter(name: str) -> bool:
    return ".adapter." in name or name == "mask_embedding"


@pytest.mark.parametrize("shard_base", ["no", "yes"])
def test_a_step_where_one_process_has_no_mask_ends_with_equal_adapters(tiny_hf, tmp_path,
                                                                        shard_base):
    """Process 1's micro-batch holds no <mask>, so only zero gradients (model.Linear) keep it in
    the gradient reduction; without them process 0 waits for it (FSDP2's reduce-scatter, or the
    all-reduce of a replicated base) and the step hangs. Both processes end with the same
    adapter, the one a single process trains on both micro-batches, up to float32 rounding."""
    micro = micro_batches()
    layout = mtp_layout(micro[1][0], k=K, offset=OFFSET, n_regions=4, mask_id=2507,
                        eos_id=EOS, pad_id=EOS)
    assert not (layout.input_ids == 2507).any()
    ranks = two_processes(tiny_hf / "base", tmp_path / "run", shard_base, "float32")
    single = one_step(Dist(), tiny_hf / "base", shard_base, micro)
    assert [r["sharded"] for r in ranks] == [shard_base == "yes"] * 2
    a, b = (r["adapter"] for r in ranks)
    assert a.keys() == b.keys() == single["adapter"].keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        torch.testing.assert_close(a[name], single["adapter"][name], atol=2e-6, rtol=1e-5)
    assert ranks[0]["stats"]["n_pred"] == single["stats"]["n_pred"] > 0


@pytest.mark.parametrize("shard_base", ["no", "yes"])
def test_the_frozen_base_is_kept_in_the_compute_dtype_on_two_processes(tiny_hf, tmp_path,
                                                                      shard_base):
    """--dtype bfloat16: the frozen base's weights in bfloat16, sharded or whole, the adapter's
    in float32 (its master weights); the two processes still end with one adapter."""
    ranks = two_processes(tiny_hf / "base", tmp_path / "run", shard_base, "bfloat16")
    for r in ranks:
        dtypes = r["dtypes"]
        assert {d for n, d in dtypes.items() if not is_adapter(n)} == {torch.bfloat16}
        assert {d for n, d in dtypes.items() if is_adapter(n)} == {torch.float32}
    a, b = (r["adapter"] for r in ranks)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_gated_step_reads_the_device_at_most_once_per_micro_batch(tiny_hf):
    """finetune_hf's train_step on one process, counted with HostSyncs, with 1 and with 3
    micro-batches: each more micro-batch may read the device once (the rows that hold <mask>);
    the statistics of all are read at once, after the last. The layout and the counts of each
    micro-batch are made on the host, before it moves to the device: they are not counted."""
    def device_reads(n):
        g = torch.Generator().manual_seed(n)
        micro = [(torch.randint(3, 2000, (2, 32), generator=g), None) for _ in range(n)]
        with HostSyncs() as on_host:
            for rows, _ in micro:
                layout = mtp_layout(rows, k=K, offset=OFFSET, n_regions=4, mask_id=2507,
                                    eos_id=EOS, pad_id=EOS)
                int(layout.valid.sum())
        step = one_step(Dist(), tiny_hf / "base", "auto", micro)
        return sum(step["syncs"].values()) - on_host.total

    assert device_reads(3) - device_reads(1) <= 2


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
