"""The memory one training process of finetune_hf.py holds, computed and not measured: support
code a learner can skip. benchmarks/memory.py prints it for Llama-3.1-8B and SmolLM2-135M.

A model is built on the meta device (shapes, no memory) as `finetune_hf.load_student_and_teacher`
builds it on one process (student_and_teacher), for a full fine-tune or the gated mask adapter.
`figures` gives its training state (mtp.distributed.training_state_bytes) and the activations of
one micro-batch (activation_bytes): its forward and loss (data.mtp_layout, then distill.mtp_loss,
or for the adapter adapter.gated_mtp_loss, whose gradient pass runs over the mask slots alone)
run on the meta device, adding up every tensor saved for backward: what the step holds when its
backward starts. How the activations are counted:
- Under autocast to bfloat16, as finetune_hf's train_step computes on one GPU. torch.autocast
  does not run on meta tensors, so `Autocast` applies its rule to the operations this model
  computes in bfloat16 (matrix products, attention): float32 inputs are cast, a weight once per
  step. A full fine-tune thus holds a bfloat16 copy of every weight matrix until backward
  (autocast's cache, saved for the input gradients) and a float32 residual stream, which casting
  the model to bfloat16 instead would miss; the adapter's base is bfloat16 already.
- Each storage is counted once (meta tensors have storages, which views share), whole where a
  saved tensor is a view of it. The student's weights are left out (the training state holds
  them); the teacher runs under no_grad and saves nothing.
- A meta tensor holds no values and picks no attention kernel. `Answers` says how many inputs are
  <mask> (the adapter's gate; counted on the CPU batch) and reads the loss's statistics as zeros;
  `FusedAttention` runs the fused kernel the CPU picks, which saves, as a GPU's fused kernels do,
  q, k, v, the output, the mask as a bias and the log-sum-exp, where meta's math path would save
  float32 scores and probabilities, (B, H, T, S) each. tests/test_memory.py checks the count
  equals the same count on real CPU tensors of a tiny model, under torch.autocast.
- Not counted: tensors that live only inside the forward or the backward (the teacher's logits,
  the logits' gradient), the CUDA context, the allocator's fragmentation.

The adapter's figures are also what each process of a distributed run holds with its frozen base
whole on every process (finetune_hf's --shard-base; only the adapter's gradients are reduced):
mtp.distributed.shard_base compares them with WHOLE_BASE_SHARE of the GPU's memory.
"""
from contextlib import ExitStack
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from adapter import ADAPTER_TARGETS, add_mask_adapter, gated_mtp_loss
from data import mtp_layout
from distill import frozen_teacher, mtp_loss
from model import ModelConfig, Transformer
from mtp.distributed import training_state_bytes

aten = torch.ops.aten

MODES = ("full", "adapter")
COMPUTE = torch.bfloat16            # finetune_hf's compute dtype on a GPU
GPU_BYTES = 80 * 2**30              # one 80 GB GPU, nothing kept back for the CUDA context
# --shard-base auto keeps the adapter's frozen base whole on every process of a distributed run
# where what one process holds (the adapter's figures) is under this share of the GPU's memory
WHOLE_BASE_SHARE = 0.8
ALPHA = 64.0                        # the adapter's scale (finetune_hf's default): no byte changes


@dataclass
class Step:
    """The shape of one micro-batch."""
    seq_len: int
    micro_batch: int
    k: int
    regions: int


def with_mask(cfg: ModelConfig) -> ModelConfig:
    """The config after add_mask_token: one more row, <mask> the last."""
    return replace(cfg, vocab_size=cfg.vocab_size + 1, mask_token_id=cfg.vocab_size)


def student_and_teacher(cfg: ModelConfig, mode: str, rank: int, device="meta"):
    """Student and teacher as finetune_hf.load_student_and_teacher builds them on one process
    (`cfg` has <mask>); on the meta device nothing is allocated."""
    with torch.device(device):
        student = Transformer(cfg)
    if mode == "adapter":     # the frozen base in the compute dtype; the adapter float32
        student.to(COMPUTE)
        add_mask_adapter(student, rank, ALPHA, ADAPTER_TARGETS)
        # its teacher is the student with the adapter off, inside gated_mtp_loss
        return student.train(), None
    return student.train(), frozen_teacher(student).to(COMPUTE)


class Answers(TorchDispatchMode):
    """What the losses ask of tensor values, answered for meta tensors (which have none): the rows
    that hold <mask> (the adapter's gate: n_mask of them), and what they read on the host: the
    statistics and a fresh KV cache's lengths (zeros), and whether the cache overflows (no)."""

    def __init__(self, n_mask: int):
        super().__init__()
        self.n_mask = n_mask

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.nonzero.default and args[0].is_meta:
            return torch.empty(self.n_mask, 1, dtype=torch.long, device="meta")
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            return False
        to_host = kwargs.get("device") == torch.device("cpu")
        if func is aten._to_copy.default and args[0].is_meta and to_host:
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        return func(*args, **kwargs)


class Autocast(TorchFunctionMode):
    """torch.autocast(dtype=bfloat16) for meta tensors, on which it does not run: the operations it
    computes in bfloat16 (for this model: matrix products and attention) get their float32 inputs
    cast, a weight once per step (autocast's cache: the copies live until backward)."""
    OPS = (F.linear, torch.matmul, torch.Tensor.__matmul__, F.scaled_dot_product_attention)

    def __init__(self):
        super().__init__()
        self.cache = {}

    def cast(self, t):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            return t
        if not (t.is_leaf and t.requires_grad):
            return t.to(COMPUTE)
        if id(t) not in self.cache:
            self.cache[id(t)] = t, t.to(COMPUTE)
        return self.cache[id(t)][1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            args = [self.cast(a) for a in args]
            kwargs = {name: self.cast(a) for name, a in kwargs.items()}
        return func(*args, **kwargs)


class FusedAttention(TorchFunctionMode):
    """On the meta device F.scaled_dot_product_attention takes the math path (it saves float32
    scores and probabilities, (B, H, T, S) each); the CPU takes a fused kernel, as the GPU does.
    Here meta tensors take the CPU's, called as scaled_dot_product_attention calls it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mask = kwargs.get("attn_mask")
        if func is not F.scaled_dot_product_attention or not args[0].is_meta or mask is None:
            return func(*args, **kwargs)
        q, k, v = args
        # a boolean mask becomes a bias in q's dtype, 0 where attending and -inf elsewhere
        # (model.attend hands over that bias already: model.kernel_mask)
        bias = mask
        if mask.dtype == torch.bool:
            bias = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)[0]


def saved_for_backward(student, teacher, batch, n_mask: int) -> int:
    """Bytes of the tensors one step's forward and loss save for backward, each storage once, the
    student's weights left out; on the meta device or any other. The loss finetune_hf trains with:
    mtp_loss, or with the adapter (teacher None) gated_mtp_loss."""
    weights = {id(s): s for s in (p.untyped_storage() for p in student.parameters())}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if id(s) not in weights:
            saved[id(s)] = s                   # held: an id is not reused while its storage lives
        return t

    if batch.input_ids.is_meta:      # Autocast, entered later, sees a call first: attention
        modes = [FusedAttention(), Autocast(), Answers(n_mask)]      # gets bfloat16 inputs
    else:
        modes = [torch.autocast(batch.input_ids.device.type, COMPUTE)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        if teacher is None:
            gated_mtp_loss(student, batch, mode="hard")
        else:
            mtp_loss(student, teacher, batch, mode="hard")
    return sum(s.nbytes() for s in saved.values())


def activation_bytes(cfg: ModelConfig, mode: str, step: Step, rank: int, device="meta") -> int:
    """Bytes saved for backward by one micro-batch's forward and loss, computed under autocast."""
    student, teacher = student_and_teacher(cfg, mode, rank, device)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, cfg.mask_token_id, (step.micro_batch, step.seq_len), generator=g)
    # No EOS: every region trains, the largest layout of this shape.
    batch = mtp_layout(seqs, step.k, 0, step.regions, cfg.mask_token_id)
    n_mask = int((batch.input_ids == cfg.mask_token_id).sum())
    return saved_for_backward(student, teacher, batch.to(device), n_mask)


def figures(cfg: ModelConfig, mode: str, step: Step, rank: int) -> dict:
    """One row of the table for `cfg` (with <mask>), in bytes: the training state as
    mtp.distributed.training_state_bytes counts it, and one micro-batch's activations."""
    student, _ = student_and_teacher(cfg, mode, rank)
    state = training_state_bytes(student, COMPUTE, teacher_copy=mode == "full")
    total, activations = sum(state.values()), activation_bytes(cfg, mode, step, rank)
    return {"parameters": student.num_params(),
            "trained": sum(p.numel() for p in student.parameters() if p.requires_grad),
            **state, "training_state": total, "activations": activations,
            "sum": total + activations, "fits_80gb": total + activations <= GPU_BYTES,
            "base_whole_on_80gb": mode == "adapter"
            and total + activations <= WHOLE_BASE_SHARE * GPU_BYTES}
