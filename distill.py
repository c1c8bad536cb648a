"""The MTP losses: student-forced self-distillation (hard / soft teacher) and the naive GT baseline.

Reference: Kirchenbauer et al., "Multi-Token Prediction via Self-Distillation" (arXiv 2602.06019).
The packed batch comes from `data.mtp_layout`: M regions per row, each a prefix followed by k-1
mask slots, with k predictions (at the last prefix token and at each mask). `mtp_loss` is one
training step, in five numbered comments.

Why one packed teacher pass is enough: slot j sees its prefix and slots 1..j of its own region
only, and holds y'_j at the position of the token it stands for, so the teacher's logits there
are exactly a plain causal forward over `prefix + y'_1..y'_j` (tests/test_distill.py checks this
against a slow per-region reference). Training on the ground-truth next k tokens instead ("gt",
the naive baseline) teaches each mask position the marginal of its token, not what fits the
guesses before it: mixtures ("panda meat") and, far ahead, the most frequent token ("the the").

The loss is reported relative to the teacher: with target q (one-hot argmax for "hard", the
teacher softmax for "soft"), loss = CE(q, student) - CE(q, teacher). The subtracted term does not
depend on the student, so the gradient is the usual cross-entropy one; for "soft" the value is
exactly KL(teacher || student), and with k = 1 and student == teacher it is 0 at step 0 (in
"hard" mode the gradient is not zero there: cross-entropy against the argmax sharpens).
"""
import copy

import torch
import torch.nn.functional as F

from data import PAD, MTPBatch

MODES = ("hard", "soft", "gt")

def frozen_teacher(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)       # a copy that never changes

def adapter_off_teacher(student: torch.nn.Module):
    """The gated mask adapter's teacher: the student itself with its adapter off, which is the
    frozen base model exactly, with no second copy in memory (model.add_mask_adapter)."""
    def teacher(*args, **kwargs):
        student.adapter_on = False
        try:
            return student(*args, **kwargs)
        finally:
            student.adapter_on = True
    return teacher

def teacher_input(batch: MTPBatch, proposals: torch.Tensor) -> torch.Tensor:
    """The student input with each region's mask slots holding the student's guesses -> (B, L).

    proposals (B, M, k): proposal j (0-based) guesses the token after slot j, so it goes into slot
    j + 1, which stands for that token (same position). The last proposal is never fed; padding
    stays padding.
    """
    B, M, k = proposals.shape
    slots = batch.pred_index[:, :, 1:].reshape(B, M * (k - 1))              # (B, M*(k-1))
    filled = batch.input_ids.scatter(1, slots, proposals[:, :, :-1].reshape(B, M * (k - 1)))
    return torch.where(batch.kind == PAD, batch.input_ids, filled)

def teacher_logits(teacher, batch: MTPBatch, proposals: torch.Tensor) -> torch.Tensor:
    """Teacher logits (float32) at the k prediction indices, student-forced -> (B, M, k, V)."""
    B, M, k = proposals.shape
    with torch.no_grad():
        logits = teacher(teacher_input(batch, proposals), positions=batch.positions, attn_mask=batch.attn_mask,
                         output_index=batch.pred_index.reshape(B, M * k))
    return logits.float().view(B, M, k, -1)

def cross_entropy(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-prediction cross-entropy against target ids (...) or a target distribution (..., V)."""
    logp = F.log_softmax(logits, dim=-1)
    if target.dtype == torch.long:
        return -logp.gather(-1, target[..., None]).squeeze(-1)
    return -(target * logp).sum(-1)

def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (values * valid).sum() / valid.sum().clamp(min=1)

def mtp_loss(student, teacher, batch: MTPBatch, mode: str = "hard",
             prefix_ntp_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The MTP loss for one packed batch -> (scalar loss with gradient into the student, stats).

    mode "hard" | "soft": student-forced self-distillation from `teacher`; "gt": the ground truth
    (teacher unused, may be None). prefix_ntp_weight adds that much ordinary next-token loss on
    the prefix tokens (an ablation; 0 in the paper's main setting). stats: loss, mtp_loss, k,
    n_pred, acc (per prediction j: how often the student's argmax equals the target; NaN where j
    has no valid prediction) and, with the prefix loss, ntp_loss."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    B, M, k = batch.pred_index.shape
    valid = batch.valid                                                     # (B, M, k)
    index = batch.pred_index.reshape(B, M * k)                              # (B, M*k)
    if prefix_ntp_weight > 0:
        index = torch.cat([index, batch.ntp_index], dim=1)                  # (B, M*k + N-1)
    # 1. the student predicts at the k indices of every region (with gradient)
    logits = student(batch.input_ids, positions=batch.positions, attn_mask=batch.attn_mask,
                     output_index=index).float()
    s_logits = logits[:, : M * k].reshape(B, M, k, -1)                      # (B, M, k, V)
    # 2. its argmax there are the proposals y' (no gradient)
    proposals = s_logits.detach().argmax(-1)                                # (B, M, k)
    if mode == "gt":                                                        # the naive baseline
        targets = batch.targets
        per_pred = cross_entropy(targets, s_logits)                         # (B, M, k)
    else:
        # 3. the frozen teacher, student-forced: mask slot j holds y'_j (same positions and mask),
        # so at j it sees prefix + y'_1..y'_{j-1}, the student's own guesses
        t_logits = teacher_logits(teacher, batch, proposals)                # (B, M, k, V)
        targets = t_logits.argmax(-1)                                       # (B, M, k)
        # 4. cross-entropy against its argmax ("hard") or distribution ("soft"), relative to its own
        q = targets if mode == "hard" else t_logits.softmax(-1)
        per_pred = cross_entropy(q, s_logits) - cross_entropy(q, t_logits)  # (B, M, k)
    # 5. the mean over valid predictions (not past the end of a row's text)
    loss = mtp = masked_mean(per_pred, valid)
    stats = {"mtp_loss": mtp, "n_pred": valid.sum(), "k": k}
    if prefix_ntp_weight > 0:
        ntp = masked_mean(cross_entropy(batch.ntp_targets, logits[:, M * k:]), batch.ntp_valid)
        loss = loss + prefix_ntp_weight * ntp
        stats["ntp_loss"] = ntp
    stats["loss"] = loss
    return loss, host_stats(stats, proposals == targets, valid)

def host_stats(stats: dict, agree: torch.Tensor, valid: torch.Tensor) -> dict:
    """`stats` with its tensors as Python numbers, plus acc: per prediction j, the share of its
    valid predictions where the student agrees with the target (NaN where j has none).
    agree, valid: (B, M, k) bool. All of it in one device-to-host copy: each float() or .item()
    would wait for the GPU on its own."""
    k = valid.shape[-1]
    names = [n for n, v in stats.items() if torch.is_tensor(v)]
    hits = torch.stack([(agree * valid).sum((0, 1)), valid.sum((0, 1))]).float()   # (2, k)
    tensors = torch.stack([stats[n].detach().float() for n in names])               # (len(names),)
    values = torch.cat([tensors, hits.reshape(-1)]).tolist()                        # the one copy
    stats.update(zip(names, values), n_pred=int(values[names.index("n_pred")]))
    n_agree, n_valid = values[len(names):][:k], values[len(names) + k:]
    stats["acc"] = [a / n if n > 0 else float("nan") for a, n in zip(n_agree, n_valid)]
    return stats
