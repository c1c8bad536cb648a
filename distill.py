"""The MTP losses: student-forced self-distillation (hard or soft teacher)
and the naive ground-truth baseline.

Reference: Kirchenbauer et al., "Multi-Token Prediction via
Self-Distillation" (arXiv 2602.06019). The packed batch comes from
`data.mtp_layout`: M regions per row, each a prefix followed by k-1 mask
slots. Indices follow data.py's convention: a region's predictions are
j = 0 .. k-1, prediction j guesses the token j + 1 places after the
prefix, prediction 0 is read at the last prefix token and prediction
j >= 1 at mask slot j. `mtp_loss` is the loss of one training step, in
five numbered comments (backward and the optimizer step belong to the
caller); adapter.py's `gated_mtp_loss` is the same loss for a model with
a gated mask adapter, which need not run its ground-truth rows with
gradient.

Why one packed teacher pass is enough: in the teacher's input, slot j
holds the student's guess of prediction j-1 at the position of the token
it guesses, and sees only its prefix and slots 1 .. j of its own region.
So the teacher's logits at prediction j are exactly a plain causal forward
over the prefix and guesses 0 .. j-1 (tests/test_distill.py checks this
against a slow per-region reference). Training on the ground-truth next k
tokens instead ("gt", the naive baseline) teaches each mask slot the
marginal of its token, not what fits the guesses before it: mixtures
("panda meat") and, far ahead, the most frequent token ("the the").

The loss is reported relative to the teacher: with target q (one-hot
argmax for "hard", the teacher softmax for "soft"),
loss = CE(q, student) - CE(q, teacher). The subtracted term does not
depend on the student, so the gradient is the usual cross-entropy one; for
"soft" the value is exactly KL(teacher || student), and with k = 1 and
student == teacher it is 0 at step 0 (in "hard" mode the gradient is not
zero there: cross-entropy against the argmax sharpens).
"""
import copy
import itertools

import torch
import torch.nn.functional as F

from data import PAD, MTPBatch

LOSSES = ("hard", "soft", "gt")


def frozen_teacher(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that never changes."""
    return copy.deepcopy(model).eval().requires_grad_(False)




def teacher_input(batch: MTPBatch, proposals: torch.Tensor) -> torch.Tensor:
    """The student input with each region's mask slots holding the
    student's guesses -> (B, L).

    proposals (B, M, k): the guess of prediction j goes into slot j + 1,
    which stands for the token it guesses (same position). The guess of
    the last prediction is never fed; padding stays padding.
    """
    slots = batch.pred_index[:, :, 1:].flatten(1)         # (B, M*(k-1))
    guesses = proposals[:, :, :-1].flatten(1)             # (B, M*(k-1))
    filled = batch.input_ids.scatter(1, slots, guesses)
    return torch.where(batch.kind == PAD, batch.input_ids, filled)


def cross_entropy(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-prediction cross-entropy against target ids (...) or a target
    distribution (..., V)."""
    logp = F.log_softmax(logits, dim=-1)
    if target.dtype == torch.long:
        return -logp.gather(-1, target[..., None]).squeeze(-1)
    return -(target * logp).sum(-1)


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (values * valid).sum() / valid.sum().clamp(min=1)


def mtp_loss(student, teacher, batch: MTPBatch, mode: str = "hard",
             prefix_ntp_weight: float = 0.0, host: bool = True) -> tuple[torch.Tensor, dict]:
    """The MTP loss for one packed batch -> (scalar loss with gradient into
    the student, stats).

    mode "hard" | "soft": student-forced self-distillation from `teacher`;
    "gt": the ground truth (teacher unused, may be None).
    prefix_ntp_weight adds that much ordinary next-token loss on the prefix
    tokens (an ablation; 0 in the paper's main setting). stats: loss,
    mtp_loss, k, n_pred, acc (per prediction j: how often the student's
    argmax equals the target; NaN where j has no valid prediction) and,
    with the prefix loss, ntp_loss. host=False: the stats are left on the
    device, unread (host_stats with read=False)."""
    if mode not in LOSSES:
        raise ValueError(f"mode must be one of {LOSSES}, got {mode!r}")
    B, M, k = batch.pred_index.shape
    valid = batch.valid                                      # (B, M, k)
    pred_index = batch.pred_index.flatten(1)                 # (B, M*k)
    index = pred_index
    if prefix_ntp_weight > 0:
        # and next-token predictions at ground-truth tokens 0 .. N-2
        index = torch.cat([index, batch.gt_index[:, :-1]], dim=1)   # (B, M*k + N-1)

    # 1. the student predicts at the k indices of every region (with gradient)
    logits = student(batch.input_ids,
                     positions=batch.positions,
                     attn_mask=batch.attn_mask,
                     output_index=index).float()
    s_logits = logits[:, : M * k].reshape(B, M, k, -1)       # (B, M, k, V)

    # 2. its argmax there are its guesses (no gradient)
    proposals = s_logits.detach().argmax(-1)                 # (B, M, k)

    if mode == "gt":
        # the naive baseline
        targets = batch.targets
        per_pred = cross_entropy(targets, s_logits)          # (B, M, k)
    else:
        # 3. the frozen teacher, student-forced: slot j holds the guess of
        # prediction j-1 (same positions and mask), so prediction j sees
        # the prefix and the student's own guesses 0 .. j-1
        with torch.no_grad():
            t_logits = teacher(teacher_input(batch, proposals),
                               positions=batch.positions,
                               attn_mask=batch.attn_mask,
                               output_index=pred_index)
        t_logits = t_logits.float().view(B, M, k, -1)        # (B, M, k, V)
        targets = t_logits.argmax(-1)                        # (B, M, k)

        # 4. cross-entropy against its argmax ("hard") or distribution
        # ("soft"), relative to its own
        q = targets if mode == "hard" else t_logits.softmax(-1)
        per_pred = cross_entropy(q, s_logits) - cross_entropy(q, t_logits)

    # 5. the mean over valid predictions (not past the end of a row's text)
    loss = mtp = masked_mean(per_pred, valid)
    stats = {"mtp_loss": mtp, "n_pred": valid.sum(), "k": k}
    if prefix_ntp_weight > 0:
        ntp_loss = cross_entropy(batch.ntp_targets, logits[:, M * k:])
        ntp = masked_mean(ntp_loss, batch.ntp_valid)
        loss = loss + prefix_ntp_weight * ntp
        stats["ntp_loss"] = ntp
    stats["loss"] = loss
    return loss, host_stats(stats, proposals == targets, valid, read=host)


def host_stats(stats: dict, agree: torch.Tensor, valid: torch.Tensor,
               read: bool = True):
    """`stats` with its tensors as Python numbers, plus acc: per prediction
    j, the share of its valid predictions where the student agrees with the
    target (NaN where j has none).

    agree, valid: (B, M, k) bool. All of it in one device-to-host copy: each
    float() or .item() would wait for the GPU on its own. read=False: no
    copy yet; (stats, its values as one tensor) for read_stats, which reads
    several micro-batches' in one copy."""
    names = [n for n, v in stats.items() if torch.is_tensor(v)]
    # (2, k): per prediction j, its agreements and its valid predictions
    hits = torch.stack([(agree * valid).sum((0, 1)), valid.sum((0, 1))]).float()
    tensors = torch.stack([stats[n].detach().float() for n in names])
    values = torch.cat([tensors, hits.reshape(-1)])
    if not read:
        return stats, values
    return read_stats([(stats, values)])[0]


def read_stats(unread: list) -> list[dict]:
    """host_stats(..., read=False)'s (stats, values) pairs as host_stats
    returns them, all read from the device in one copy."""
    sizes = [len(values) for _, values in unread]
    read = torch.cat([values for _, values in unread]).tolist()
    out = []
    for (stats, _), end, size in zip(unread, itertools.accumulate(sizes), sizes):
        values = read[end - size:end]
        names = [n for n, v in stats.items() if torch.is_tensor(v)]
        stats = {**stats, **dict(zip(names, values))}
        stats["n_pred"] = int(stats["n_pred"])
        # per prediction j: its agreements, then its valid predictions
        counts = values[len(names):]
        k = len(counts) // 2
        stats["acc"] = [a / n if n > 0 else float("nan")
                        for a, n in zip(counts[:k], counts[k:])]
        out.append(stats)
    return out
