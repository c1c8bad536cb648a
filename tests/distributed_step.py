"""One training step of the gated adapter, as finetune_hf.py takes it (its own
load_student_and_teacher and train_step), for tests/test_distributed.py: on one process, or on two
gloo processes as

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_step.py \
        MODEL OUT SHARD_BASE DTYPE

where process 0 trains the first micro-batch of `micro_batches` and process 1 the second, which
holds no <mask>. The process group gives up after two minutes: a process left waiting in a
collective fails rather than hangs. Each process writes OUT/rank_R.pt (`one_step`'s dict).
"""
import argparse
import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import finetune_hf  # noqa: E402
from adapter import ADAPTER_TARGETS  # noqa: E402
from mtp.distributed import Dist, end_worker, setup_processes  # noqa: E402
from mtp.engine import HostSyncs  # noqa: E402

# The word-problem tokenizer's EOS (tests/conftest.py's tiny_hf): the rows' end and padding.
EOS = 2505
SEQ_LEN = 32
K = 4
# The first region ends at token OFFSET: a row that ends before it supervises nothing.
OFFSET = 5


def micro_batches(n=2, rows=2) -> list:
    """n micro-batches of `rows` random rows each, (rows, None) as train_step takes them; from
    the second on, every row ends (EOS) at token 1, so those hold no <mask>."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        seqs = torch.randint(3, 2000, (rows, SEQ_LEN), generator=g)
        if i > 0:
            seqs[:, 1] = EOS
        out.append((seqs, None))
    return out


def one_step(dist: Dist, model, shard_base: str, micro: list) -> dict:
    """This process's step on its micro-batches -> its adapter (whole), its parameters' dtypes
    (name -> dtype), the step's statistics, the host syncs of the step by kind, and whether the
    base was sharded."""
    args = argparse.Namespace(
        model=str(model), adapter="gated-lora", adapter_rank=4, adapter_alpha=8.0,
        adapter_targets=list(ADAPTER_TARGETS), adapter_slot_embeddings=False,
        shard_base=shard_base, mode="hard",
        regions=4, seq_len=SEQ_LEN, micro_batch=len(micro[0][0]), k_max=K, clip=1.0)
    student, _, _, mask_id = finetune_hf.load_student_and_teacher(args, dist, with_teacher=False)
    optimizer = student.configure_optimizer(1e-2, 0.0, (0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with HostSyncs() as syncs:
        stats = finetune_hf.train_step(student, None, optimizer, scheduler, micro, k=K,
                                       offset=OFFSET, args=args, dist=dist, mask_id=mask_id,
                                       pad=EOS)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    adapter = get_model_state_dict(student, options=options)
    return {"adapter": {n: t.detach().cpu() for n, t in adapter.items()},
            "dtypes": {n: p.dtype for n, p in student.named_parameters()},
            "stats": stats, "syncs": dict(syncs.counts), "sharded": dist.sharded}


if __name__ == "__main__":
    model, out, shard_base, dtype = sys.argv[1:]
    dist = setup_processes("cpu", dtype, timeout=timedelta(minutes=2))
    try:
        result = one_step(dist, model, shard_base, micro_batches()[dist.rank:dist.rank + 1])
        torch.save(result, os.path.join(out, f"rank_{dist.rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()
    end_worker(0)
