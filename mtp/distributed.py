"""Processes, dtypes, FSDP2 sharding and distributed checkpoints for finetune_hf.py's
`train`: the plumbing that lets one training loop run on one process or, under
torchrun, over many. Not part of the method: a learner can skip it.

One process computes in --dtype under torch.autocast. Under torchrun every process
holds a shard of each model (FSDP2, one all-gather unit per block, then the root)
and computes in --dtype through FSDP2's MixedPrecisionPolicy; rank 0 alone reads
files, logs and writes, and a checkpoint holds each process's shards
(torch.distributed.checkpoint). The gated adapter's frozen base is kept in the
compute dtype, and where it fits one device (--shard-base) it is not sharded at
all: every process holds it whole, as one process does, and only the adapter's
gradients are averaged, in one all-reduce a step.
"""

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from distill import frozen_teacher
from adapter import add_mask_adapter
from model import Transformer
from mtp.cli import parse_device, parse_dtype


@dataclass
class Dist:
    """The process group as train sees it: one process, or one of torchrun's."""
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    # What the matrix multiplications compute in.
    dtype: torch.dtype = torch.float32
    # Under torchrun: one of a process group, at any world size.
    group: bool = False
    # The models FSDP2-sharded over the group; else each process holds them whole
    # (the gated adapter on a replicated base).
    sharded: bool = False
    # Rank 0 alone reads, logs and writes files.
    main = property(lambda self: self.rank == 0)

    def log(self, message: str):
        if self.main:
            print(message, flush=True)

    def all_sum(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        if self.group:
            torch.distributed.all_reduce(t)
        return float(t)

    def barrier(self):
        if self.group:
            torch.distributed.barrier()


def setup_processes(device: str, dtype: str = "auto",
                    timeout: timedelta = timedelta(hours=1)) -> Dist:
    """This process's Dist from --device and --dtype: one process, or under
    torchrun (WORLD_SIZE set) one of a process group it joins, whose collectives
    fail after `timeout` rather than wait for ever."""
    device = parse_device(device)
    torchrun = "WORLD_SIZE" in os.environ
    compute = parse_dtype(dtype, device)
    # Under torchrun: one GPU per process, whatever --device named.
    if device.type == "cuda":
        if torchrun:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not torchrun:
        return Dist(device=device, dtype=compute)

    # Rank 0 alone loads and exports while the others wait: on a slow disk,
    # longer than NCCL's default 10 minutes.
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, timeout=timeout)
    # gloo computes in float32.
    if device.type == "cpu" and dtype == "auto":
        compute = torch.float32
    return Dist(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(),
                device=device, dtype=compute, group=True, sharded=True)


def end_worker(code: int):
    """End a torchrun worker now, with exit status `code`, its process group already
    destroyed and its files written. gloo's threads can still hold a finished
    collective (a barrier holds the ones before it) whose tensors only Python can
    free; if they let go once the interpreter has begun to shut down, the process
    aborts ("terminate called without an active exception", SIGABRT) after a run
    that went well. Leaving at once, without that shutdown, cannot race them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard_base(choice: str, cfg, args, dist: Dist) -> bool:
    """--shard-base for the gated adapter under torchrun: whether its frozen base
    is FSDP2-sharded (yes) or whole on every process (no). auto shards only where
    a whole copy would not fit: what one process then holds (mtp.memory.figures:
    its training state and one micro-batch's activations) over 80% of the GPU's
    memory. On a CPU auto keeps it whole: the processes share the machine's
    memory, which nothing here measures."""
    if choice != "auto":
        return choice == "yes"
    if dist.device.type != "cuda":
        return False
    from data import default_n_regions
    from mtp.memory import WHOLE_BASE_SHARE, Step, figures
    regions = args.regions or default_n_regions(args.seq_len, args.k_max)
    step = Step(args.seq_len, args.micro_batch, args.k_max, regions)
    need = figures(cfg, "adapter", step, args.adapter_rank)
    # figures counts a bfloat16 base; a float32 one is twice its weights
    total = need["sum"] + need["weights"] * (dist.dtype.itemsize // 2 - 1)
    have = torch.cuda.get_device_properties(dist.device).total_memory
    shard = total > WHOLE_BASE_SHARE * have
    dist.log(f"--shard-base auto: one process would hold {total / 2**30:.1f} GB of the "
             f"GPU's {have / 2**30:.1f} GB: the frozen base "
             f"{'sharded' if shard else 'whole on every process'}")
    return shard


def replicate_from_rank0(full, cfg, dist: Dist, adapter) -> Transformer:
    """The gated adapter's student whole on every process: rank 0's `full` model
    (None on the other ranks), its frozen base in the compute dtype and the
    adapter (rank, alpha, targets) in float32, broadcast to every process."""
    if dist.main:
        student = full.to(dist.dtype)
    else:
        with torch.device("meta"):
            student = Transformer(cfg).to(dist.dtype)
    add_mask_adapter(student, *adapter)
    if dist.main:
        student.to(dist.device)
    else:
        # RoPE frequencies are computed again.
        student.to_empty(device=dist.device)
    for t in student.state_dict().values():
        torch.distributed.broadcast(t, src=0)
    return student


def average_gradients(model, dist: Dist):
    """Each trained tensor's gradient averaged over the processes, in one
    all-reduce: for a model every process holds whole. Every trained tensor has
    one, zeros where a micro-batch held no <mask> (model.Linear)."""
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= dist.world
    for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(mean.view_as(g))


def training_state_bytes(model, compute_dtype: torch.dtype, teacher_copy: bool) -> dict:
    """Bytes the training state holds beside the activations, as built: the
    weights (float32 master weights; a gated adapter's frozen base in the
    compute dtype), a teacher copy in the compute dtype, float32 gradients and
    AdamW's two float32 moments of each trained weight."""
    params = list(model.parameters())
    trained = sum(p.numel() for p in params if p.requires_grad)
    teacher = 0
    if teacher_copy:
        teacher = sum(p.numel() for p in params) * compute_dtype.itemsize
    return {"weights": sum(p.numel() * p.element_size() for p in params),
            "teacher": teacher, "gradients": 4 * trained, "AdamW": 8 * trained}


def shard_from_rank0(full, cfg, dist: Dist, adapter=None, with_teacher: bool = True):
    """(student, frozen teacher or None), FSDP2-sharded over the process group.
    Every rank builds the same modules on the meta device (no memory), shards
    each block, then the root; rank 0's `full` model (None on the other ranks)
    is broadcast straight into every process's shards. `adapter`: the (rank,
    alpha, targets) of a gated mask adapter, whose teacher is no copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        student = Transformer(cfg)
    # The adapter's frozen base in the compute dtype; the adapter float32.
    if adapter:
        student.to(dist.dtype)
        add_mask_adapter(student, *adapter)
        if dist.main:
            full.to(dist.dtype)
            add_mask_adapter(full, *adapter)
    models = [student]
    teacher = None
    if with_teacher and not adapter:
        teacher = frozen_teacher(student).to(dist.dtype)
        models.append(teacher)
    # A mesh for the device: fully_shard's default would put a `--device cpu`
    # run's shards on a GPU.
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    mp = MixedPrecisionPolicy(param_dtype=dist.dtype, reduce_dtype=torch.float32)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for model in models:
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        # FSDP2 keeps a root's parameters gathered after its forward, for the
        # backward that follows; the teacher has no backward, so its embedding
        # and output layer would stay whole on every rank unless told to reshard
        # (None: FSDP2's default).
        reshard = True if model is teacher else None
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        # RoPE frequencies are computed again.
        model.to_empty(device=dist.device)
        set_model_state_dict(model, full.state_dict() if dist.main else {}, options=from_rank0)
    return student, teacher


# --- checkpoints: finding the last one, and what a resume must match ---

# The settings a run keeps from its first step to its last: resuming with any
# other value would train a different run.
RESUME_MUST_MATCH = ("model", "data", "format", "seq_len", "response_only", "mode",
                     "prefix_ntp_weight", "adapter", "k_max", "regions", "batch_size", "lr",
                     "warmup", "decay", "weight_decay", "beta1", "beta2", "seed")
ADAPTER_SETTINGS = ("adapter_rank", "adapter_alpha", "adapter_targets",
                    "adapter_slot_embeddings")
# what a run's saved arguments that lack a setting (runs from before it) trained with
ABSENT = {"adapter": "none", "adapter_slot_embeddings": False}


def latest_checkpoint(out) -> Path | None:
    """The checkpoint `checkpoints/latest` names in a run's folder, if it is whole."""
    pointer = Path(out) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "trainer.pt").is_file():
        return None
    return path


def check_same_run(old: dict, new: dict, path):
    """Refuse to resume from the checkpoint at `path`, whose run had the arguments
    `old`, with arguments `new` that change any setting of RESUME_MUST_MATCH."""
    def setting(name, run: dict):
        # Arguments that do not name a setting had its default (runs from before
        # it); paths compare as real paths.
        value = run.get(name, ABSENT.get(name))
        if name not in ("model", "data") or value is None:
            return value
        paths = [value] if isinstance(value, str) else value
        return [os.path.realpath(p) for p in paths]

    keys = RESUME_MUST_MATCH
    if setting("adapter", new) != "none":
        keys += ADAPTER_SETTINGS
    changed = [f"--{k.replace('_', '-')} {setting(k, old)} -> {setting(k, new)}"
               for k in keys if setting(k, old) != setting(k, new)]
    if changed:
        raise ValueError(f"cannot resume from {path}: settings differ from the interrupted "
                         f"run ({'; '.join(changed)})")


def load_shards(state: dict, path: Path):
    """torch.distributed.checkpoint.load of this process's shards into `state`,
    a truncated or corrupt checkpoint told in one line."""
    import torch.distributed.checkpoint as dcp
    try:
        dcp.load(state, checkpoint_id=str(path))
    # dcp wraps the reader's error in its own exception type.
    except Exception as e:
        raise ValueError(f"cannot read the checkpoint {path}: truncated or corrupt "
                         f"({type(e).__name__}); resume from an earlier one by pointing "
                         f"{path.parent}/latest at it") from None
