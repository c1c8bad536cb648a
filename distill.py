"""The MTP losses: student-forced self-distillation (hard / soft teacher) and the naive GT baseline.

Reference: Kirchenbauer et al., "Multi-Token Prediction via Self-Distillation" (arXiv 2602.06019).
The packed batch comes from `data.mtp_layout`.

One training step, for M regions of k predictions per row:

    1. student forward over the packed sequence (with gradient), logits only at the k
       prediction indices of every region: the last prefix token and the k-1 mask slots;
    2. proposals y' = argmax of those logits (deterministic, no gradient);
    3. teacher input = the student input with slot j of each region holding y'_{j-1},
       i.e. the region's prefix followed by the student's own guesses ("student forcing");
       same positions, same attention mask;
    4. teacher forward under no_grad: its logits at the same k indices are the teacher's
       next-token distributions given prefix + y'_1..y'_{j-1}, the chain-rule targets;
    5. loss averaged over the valid predictions.

Why one packed teacher pass is enough: slot j sees the prefix and slots 1..j of its own block
only, and now holds y'_j at the position of the token it stands for, so the teacher's logits
there are exactly a plain causal forward over `prefix + y'_1..y'_j` (tests/test_distill.py
checks this against a slow per-region reference).

The loss is reported relative to the teacher. With target distribution q (one-hot argmax
for "hard", the teacher softmax for "soft"),

    loss = CE(q, student) - CE(q, teacher)

The subtracted term does not depend on the student, so the gradient is the usual
cross-entropy gradient; for "soft" the value is exactly KL(teacher || student). With k = 1 and
student == teacher the value is 0 at step 0. In "hard" mode the gradient is NOT zero there:
cross-entropy against the argmax sharpens the distribution. "gt" is plain cross-entropy
against the ground-truth next k tokens (the naive baseline).
"""
import copy

import torch
import torch.nn.functional as F

from data import PAD, MTPBatch

MODES = ("hard", "soft", "gt")


def frozen_teacher(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` in eval mode with every parameter frozen: the teacher."""
    teacher = copy.deepcopy(model).eval()
    teacher.requires_grad_(False)
    return teacher


def logits_at(model, batch: MTPBatch, input_ids, output_index) -> torch.Tensor:
    """One packed forward; logits (float32) only at output_index (B, P) -> (B, P, V)."""
    logits = model(input_ids, positions=batch.positions, attn_mask=batch.attn_mask, output_index=output_index)
    return logits.float()


def teacher_input(batch: MTPBatch, proposals: torch.Tensor) -> torch.Tensor:
    """The student input with each region's mask slots replaced by the student's guesses -> (B, L).

    proposals (B, M, k): the student's argmax at the k predictions of each region; proposal
    j (0-based) guesses original token e_r + 1 + j, so it goes into slot j + 1, the slot that
    stands for that token (same position). The last proposal is never fed (nothing comes
    after it). Padding stays padding.
    """
    B, M, k = proposals.shape
    slots = batch.pred_index[:, :, 1:].reshape(B, M * (k - 1))              # (B, M*(k-1))
    filled = batch.input_ids.scatter(1, slots, proposals[:, :, :-1].reshape(B, M * (k - 1)))
    return torch.where(batch.kind == PAD, batch.input_ids, filled)


def teacher_logits(teacher, batch: MTPBatch, proposals: torch.Tensor) -> torch.Tensor:
    """Teacher logits at the k prediction indices, student-forced -> (B, M, k, V). No gradient."""
    B, M, k = proposals.shape
    with torch.no_grad():
        logits = logits_at(teacher, batch, teacher_input(batch, proposals), batch.pred_index.reshape(B, M * k))
    return logits.view(B, M, k, -1)                                         # (B, M, k, V)


def cross_entropy(target_probs_or_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-prediction cross-entropy; target ids (...) or a target distribution (..., V) -> (...)."""
    logp = F.log_softmax(logits, dim=-1)
    if target_probs_or_ids.dtype == torch.long:
        return -logp.gather(-1, target_probs_or_ids[..., None]).squeeze(-1)
    return -(target_probs_or_ids * logp).sum(-1)


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (values * valid).sum() / valid.sum().clamp(min=1)


def per_position_sums(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sums of values (B, M, k) and of valid over batch and regions, per prediction j -> (2, k)."""
    return torch.stack([(values.float() * valid).sum((0, 1)), valid.sum((0, 1)).float()])


def to_host(**tensors) -> dict:
    """Statistics in one device-to-host copy (each float() would wait for the GPU on its own):
    a 0-d tensor becomes a float, an (r, c) one r lists of c floats."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors.values()]).tolist()
    out, i = {}, 0
    for name, t in tensors.items():
        values, c = flat[i:i + t.numel()], t.shape[-1] if t.dim() else 1
        out[name] = values[0] if t.dim() == 0 else [values[r:r + c] for r in range(0, len(values), c)]
        i += t.numel()
    return out


def per_position_mean(sums) -> list[float]:
    """[sums of values, counts] per prediction j -> the means (NaN where j has no valid prediction)."""
    return [n / d if d > 0 else float("nan") for n, d in zip(*sums)]


def mtp_loss(student, teacher, batch: MTPBatch, mode: str = "hard",
             prefix_ntp_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The MTP loss for one packed batch -> (scalar loss with gradient into the student, stats).

    mode "hard" | "soft": student-forced self-distillation from `teacher`; "gt": ground truth
    (teacher unused, may be None). prefix_ntp_weight adds that much ordinary next-token
    cross-entropy on the ground-truth tokens (an ablation; 0 in the paper's main setting).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    B, M, k = batch.pred_index.shape
    valid = batch.valid
    want_ntp = prefix_ntp_weight > 0
    index = batch.pred_index.reshape(B, M * k)                              # (B, M*k)
    if want_ntp:
        index = torch.cat([index, batch.ntp_index], dim=1)                  # (B, M*k + N-1)
    logits = logits_at(student, batch, batch.input_ids, index)
    s_logits = logits[:, : M * k].reshape(B, M, k, -1)                      # (B, M, k, V)
    proposals = s_logits.detach().argmax(-1)                                # (B, M, k) y'

    if mode == "gt":
        targets = batch.targets
        per_pred = cross_entropy(targets, s_logits)                         # (B, M, k)
    else:
        t_logits = teacher_logits(teacher, batch, proposals)                # (B, M, k, V)
        if mode == "hard":
            targets = t_logits.argmax(-1)                                   # (B, M, k)
            q = targets
        else:
            q = t_logits.softmax(-1)                                        # (B, M, k, V)
            targets = t_logits.argmax(-1)                                   # for the agreement stats
        student_ce = cross_entropy(q, s_logits)                             # (B, M, k)
        per_pred = student_ce - cross_entropy(q, t_logits)                  # (B, M, k)

    mtp = masked_mean(per_pred, valid)
    loss = mtp
    stats = {"mtp_loss": mtp, "n_pred": valid.sum(),
             "acc": per_position_sums(proposals == targets, valid),         # student argmax == target, per j
             "gt_acc": per_position_sums(proposals == batch.targets, valid)}
    if mode != "gt":
        stats["ce"] = masked_mean(student_ce.detach(), valid)
    if want_ntp:
        ntp_logits = logits[:, M * k:]                                      # (B, N-1, V)
        ntp = masked_mean(cross_entropy(batch.ntp_targets, ntp_logits), batch.ntp_valid)
        loss = loss + prefix_ntp_weight * ntp
        stats["ntp_loss"] = ntp
    stats = to_host(**stats, loss=loss)
    stats.update(k=k, n_pred=int(stats["n_pred"]), acc=per_position_mean(stats["acc"]),
                 gt_acc=per_position_mean(stats["gt_acc"]))
    return loss, stats
