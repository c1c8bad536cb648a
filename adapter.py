"""The gated mask adapter: multi-token prediction that keeps the model's own
text exact.

An alternative to tuning every weight: freeze the model, and train only a
low-rank update to chosen projections plus a <mask> embedding of its own
(or one per mask slot), both acting only at the rows whose input token is
<mask>. model.py holds the hooks: `Linear.forward` calls the update
(`GatedLowRank.forward`), `Transformer.embed` is the gate.
Ordinary tokens never attend to mask slots, in training and in decoding,
so at every ordinary position the hidden states, cache entries and logits
stay exactly the base model's:

- greedy decoding and the lossless mode print the untuned model's text;
- the distillation teacher is the student itself with the adapter off,
  with no second copy in memory (`adapter_off_teacher`);
- a training step runs the ground truth once, without gradient, and only
  the mask slots with it (`gated_mtp_loss`).

It is saved as a small folder beside the unchanged base model. It is not a
plain LoRA: applied at every position, it would change them all, so its
files have names of their own and no LoRA loader merges it.
"""

import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import PAD, MTPBatch
from distill import LOSSES, cross_entropy, host_stats, masked_mean
from model import KVCache, Linear, Transformer, attend
from mtp.calibration import config_temperatures, set_mask_temperatures
from mtp.folders import base_record
from mtp.hf import atomic_save, read_json, write_json

ADAPTER_CONFIG = "mask_adapter.json"
ADAPTER_WEIGHTS = "mask_adapter.safetensors"
ADAPTER_TYPE = "gated-mask-lora"
ADAPTER_TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")


class GatedLowRank(nn.Module):
    """The gated mask adapter of one projection: scale * up(down(x)), which
    Linear.forward adds only at the rows whose input token is <mask>. `up`
    starts at zero, so a new adapter changes nothing."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float,
                 generator=None):
        super().__init__()
        down = torch.randn(rank, d_in, generator=generator) / math.sqrt(d_in)
        self.down = nn.Parameter(down)
        self.up = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = alpha / rank

    def forward(self, x, y, mask_rows):
        """y with the update added in place at mask_rows, computed in the
        adapter's dtype (y's backward does not need y)."""
        # With no mask row a trained adapter still runs, on zero rows: its
        # tensors get a gradient (zeros), so every process of a distributed
        # step reduces the same ones.
        if len(mask_rows) == 0 and not self.up.requires_grad:
            return y
        # (n_mask, d_in) -> (n_mask, d_out)
        x_mask = x.reshape(-1, x.shape[-1]).index_select(0, mask_rows)
        update = F.linear(F.linear(x_mask.to(self.down.dtype), self.down), self.up)
        y.view(-1, y.shape[-1]).index_add_(0, mask_rows, update.to(y.dtype),
                                           alpha=self.scale)
        return y


def add_mask_adapter(model: Transformer, rank: int, alpha: float,
                     targets=ADAPTER_TARGETS, slots: int = 0, seed: int = 0):
    """Freeze `model` (which has <mask>) and give it a fresh gated mask
    adapter: a GatedLowRank on each Linear named in targets (seeded), and a
    trainable <mask> embedding starting at the current one; with `slots`,
    one for each of the first `slots` <mask>s after ordinary text (slot j
    guesses the token j + 1 places on), so each slot knows its distance."""
    if model.config.mask_token_id is None:
        raise ValueError("the gated mask adapter needs a model with a <mask> "
                         "token (add_mask_token)")
    unknown = sorted(set(targets) - set(ADAPTER_TARGETS))
    if unknown:
        choices = ", ".join(ADAPTER_TARGETS)
        raise ValueError(f"unknown adapter targets {unknown}; "
                         f"choose from {choices}")

    model.requires_grad_(False)
    device = model.tok_emb.weight.device
    generator = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in targets:
            # built where the generator is
            with torch.device("cpu"):
                adapter = GatedLowRank(module.in_features, module.out_features,
                                       rank, alpha, generator)
            module.adapter = adapter.to(device)
    row = model.tok_emb.weight[model.config.mask_token_id].detach().float()
    if slots:
        row = row.expand(slots, -1)                      # (slots, dim)
    model.mask_embedding = nn.Parameter(row.clone())
    model.adapter_config = {"rank": rank, "alpha": alpha,
                            "targets": list(targets), "mask_slots": slots}


def check_slots(model: Transformer, k: int):
    """Decoding k positions a row feeds up to k - 1 <mask>s: refuse more than
    an adapter of one embedding per slot was trained with."""
    embedding = model.mask_embedding
    if embedding is not None and embedding.dim() == 2 and k - 1 > len(embedding):
        raise ValueError(f"this adapter was trained with {len(embedding)} <mask> "
                         f"slots: decode with k_max at most {len(embedding) + 1}, "
                         f"not {k}")


# ---- training: the teacher is the student with its adapter off ----------

def adapter_off_teacher(student: torch.nn.Module):
    """The gated mask adapter's teacher: the student itself called with its
    adapter off, which is the frozen base model exactly, with no second copy
    in memory."""
    return functools.partial(student, use_adapter=False)


class ContextCache:
    """A read-only KV cache for the mask slots of gated_mtp_loss: the tokens
    attend over the first S slots of `context` (the ground truth), then over
    each other, under mask (B, T, S + T). Nothing is written, so gradients
    reach the tokens' own keys and values."""

    def __init__(self, context: KVCache, mask):
        self.context = context
        # the same for every head
        self.mask = mask[:, None]                        # (B, 1, T, S + T)
        self.S = mask.shape[-1] - mask.shape[-2]

    def attend(self, layer: int, q, k, v):
        """q (B, n_heads, T, hd), k and v (B, n_kv, T, hd): the tokens' own."""
        context_k = self.context.k[layer, :, :, : self.S].to(k.dtype)
        context_v = self.context.v[layer, :, :, : self.S].to(v.dtype)
        k = torch.cat([context_k, k], dim=2)             # (B, n_kv, S + T, hd)
        v = torch.cat([context_v, v], dim=2)
        return attend(q, k, v, self.mask)

    def advance(self, T: int):
        """Nothing to store: the context is only read."""


def gated_mtp_loss(student, batch: MTPBatch, mode: str = "hard",
                   host: bool = True) -> tuple[torch.Tensor, dict]:
    """distill.mtp_loss(student, adapter_off_teacher(student), batch, mode,
    host=host) for a student with a gated mask adapter, in less work
    (gated_predictions): cross-entropy against the teacher's argmax or
    distribution, relative to its own, as in mtp_loss, over valid predictions."""
    s_logits, t_logits, targets, proposals = gated_predictions(student, batch, mode)
    q = targets if mode != "soft" else t_logits.softmax(-1)
    per_pred = cross_entropy(q, s_logits)                # (B, M, k)
    if mode != "gt":
        per_pred = per_pred - cross_entropy(q, t_logits)
    loss = masked_mean(per_pred, batch.valid)
    stats = {"mtp_loss": loss, "n_pred": batch.valid.sum(), "k": s_logits.shape[2], "loss": loss}
    return loss, host_stats(stats, proposals == targets, batch.valid, read=host)


def gated_predictions(student, batch: MTPBatch, mode: str = "hard"):
    """What gated_mtp_loss scores: the student's logits s_logits (B, M, k, V),
    the teacher's t_logits (None with mode gt), the targets (B, M, k) (the
    teacher's argmax; gt: the ground truth) and the student's argmax.

    The adapter acts only at <mask> rows, and ground-truth rows never see a
    slot, so every ground-truth row of the packed input is the base model's,
    for student and teacher alike, and nothing trained reaches it. So the
    ground truth runs once, without gradient, as a plain causal pass that
    fills a KV cache; then only the mask slots run, reading that cache: with
    gradient for the student, and again holding the student's guesses for
    the teacher. Prediction 0, read at a ground-truth row, is the base
    model's next token for both (its distillation loss is 0). At N = 160,
    80 regions and k = 4, 240 of the packed row's 400 rows run with
    gradient, and the 160 others run once instead of twice."""
    if mode not in LOSSES:
        raise ValueError(f"mode must be one of {LOSSES}, got {mode!r}")
    B, M, k = batch.pred_index.shape
    N = batch.gt_index.shape[1]

    # 1. The ground-truth tokens alone, once, base model, no gradient: their
    # keys and values fill a cache (slot i holds ground-truth token i), and
    # each region's last prefix token gives prediction 0.
    cache = student.new_cache(B, N)
    with torch.no_grad():
        first = student(batch.input_ids.gather(1, batch.gt_index),
                        cache=cache,
                        output_index=batch.prefix_end.expand(B, M),
                        use_adapter=False)
    first = first.float()[:, :, None]                    # (B, M, 1, V)

    # 2. What a mask slot sees: the packed mask's rows for the slots, and its
    # columns for the ground truth (the cache), then the slots themselves.
    slots = batch.pred_index[:, :, 1:].flatten(1)        # (B, n), n = M*(k-1)
    rows = torch.arange(B, device=slots.device)[:, None, None]
    seen = torch.cat([batch.gt_index, slots], dim=1)     # (B, N + n)
    # (B, n, N + n)
    slot_mask = batch.attn_mask[rows, slots[:, :, None], seen[:, None, :]]
    slot_positions = batch.positions.gather(1, slots)    # (B, n)
    after_ground_truth = ContextCache(cache, slot_mask)
    # regions sit side by side: each slot's number, 1 .. k-1, given
    slot_numbers = torch.arange(1, k, device=slots.device).repeat(M).expand(B, -1)

    def slot_logits(tokens, use_adapter):
        logits = student(tokens,
                         positions=slot_positions,
                         cache=after_ground_truth,
                         use_adapter=use_adapter,
                         mask_slots=slot_numbers)
        V = logits.shape[-1]
        return logits.float().view(B, M, k - 1, V)       # (B, M, k-1, V)

    # 3. The student's mask slots, adapter on, with gradient: predictions
    # 1 .. k-1. Their argmax are its guesses (no gradient).
    masks = slot_logits(batch.input_ids.gather(1, slots), True)
    s_logits = torch.cat([first, masks], dim=2)          # (B, M, k, V)
    proposals = s_logits.detach().argmax(-1)             # (B, M, k)

    t_logits = None
    targets = batch.targets
    if mode != "gt":
        # 4. The teacher, adapter off, no gradient: the slots again, slot j
        # holding the guess of prediction j-1 (padding stays padding).
        guesses = proposals[:, :, :-1].flatten(1)        # (B, n)
        is_pad = batch.kind.gather(1, slots) == PAD
        padding = batch.input_ids.gather(1, slots)
        teacher_slots = torch.where(is_pad, padding, guesses)
        with torch.no_grad():
            guessed = slot_logits(teacher_slots, False)
            t_logits = torch.cat([first, guessed], dim=2)
        targets = t_logits.argmax(-1)                    # (B, M, k)
    return s_logits, t_logits, targets, proposals


# ---- saving and loading: a small folder that names its base model --------

def is_adapter_tensor(name: str) -> bool:
    return ".adapter." in name or name == "mask_embedding"


def adapter_state(model: Transformer) -> dict:
    """The adapter's tensors by name: what it saves and trains."""
    state = model.state_dict().items()
    return {name: t for name, t in state if is_adapter_tensor(name)}


def save_mask_adapter(model: Transformer, path, base_model,
                      dtype=torch.float32):
    """Write the adapter (in `dtype`) and its config into folder `path`,
    naming the base folder."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {n: t.detach().to(dtype).contiguous().cpu()
               for n, t in adapter_state(model).items()}
    file = os.path.join(path, ADAPTER_WEIGHTS)
    metadata = {"format": "pt"}
    atomic_save(lambda p: save_file(tensors, p, metadata=metadata), file)
    config = {
        "adapter_type": ADAPTER_TYPE,
        "applies_at": "input positions holding mask_token_id only; "
                      "every other position is the base model",
        "base_model": os.path.relpath(base_model, path),
        # format_version and a fingerprint: loading refuses any other base
        **base_record(base_model),
        **model.adapter_config,
        "mask_token_id": model.config.mask_token_id,
    }
    write_json(os.path.join(path, ADAPTER_CONFIG), config)


def is_adapter_folder(path) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_adapter_config(path) -> dict:
    """The adapter's config, with base_model resolved to a path (it is stored
    relative to `path`)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    config = read_json(file, "mask adapter config")
    fields = ("adapter_type", "base_model", "rank", "alpha", "targets",
              "mask_token_id")
    missing = [k for k in fields if k not in config]
    if missing:
        raise ValueError(f"{file}: missing {', '.join(missing)}")
    if config["adapter_type"] != ADAPTER_TYPE:
        raise ValueError(f"{file}: adapter_type is not {ADAPTER_TYPE!r}")
    base = os.path.join(path, config["base_model"])
    config["base_model"] = os.path.normpath(base)
    return config


def load_mask_adapter(model: Transformer, path, calibrated: bool = True):
    """Attach the adapter saved in folder `path` to its base model (with <mask>
    added), frozen, for decoding. Its tensors stay float32 whatever the base's
    dtype, and Linear.forward computes the update in their dtype: a CPU multiplies
    a pass's few mask rows by the small matrices about 5x faster in float32 than in
    bfloat16 (in training, autocast or FSDP2 choose the dtype). calibrated: with the
    folder's temperatures, where it has them (mtp/calibration.py)."""
    from safetensors.torch import load_file
    config = read_adapter_config(path)
    ours = config["mask_token_id"]
    if model.config.mask_token_id != ours:
        raise ValueError(f"{path}: the adapter's <mask> is token {ours}, "
                         f"the model's is {model.config.mask_token_id}")
    add_mask_adapter(model, config["rank"], config["alpha"], config["targets"],
                     slots=config.get("mask_slots", 0))
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in {path}")

    tensors = load_file(file)
    expected = adapter_state(model)
    wrong = sorted(set(tensors) ^ set(expected))
    wrong += [n for n in expected
              if n in tensors and tensors[n].shape != expected[n].shape]
    if wrong:
        names = ", ".join(wrong[:3])
        raise ValueError(f"{file} does not match its config: {names}")
    model.load_state_dict(tensors, strict=False)
    set_mask_temperatures(model, calibrated and config_temperatures(config, path))
    return model.requires_grad_(False)
