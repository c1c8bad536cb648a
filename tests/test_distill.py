"""The MTP losses (distill.py): zero at the start, the packed teacher equals the slow chain rule.

The slow references below spell the method out region by region with plain causal forwards
and no layout at all; the packed implementation must agree with them.
"""
import pytest
import torch
import torch.nn.functional as F

from data import PAD, mtp_layout
from distill import frozen_teacher, mtp_loss, teacher_input
from model import ModelConfig, Transformer

VOCAB, MASK_ID, EOS_ID, PAD_ID = 50, 49, 1, 0


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    return Transformer(cfg)


def perturbed(model, seed=1, scale=0.05):
    """A copy of `model` with noisy weights, so the student's proposals differ from the teacher's."""
    other = tiny_model()
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def batch_with_eos(k, offset=2, n_regions=2, N=16):
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(2, MASK_ID, (3, N), generator=g)     # row 0 has no EOS
    seqs[1, 12] = EOS_ID                                       # row 1 ends in the last region
    seqs[1, 13:] = PAD_ID
    seqs[2, 5] = EOS_ID                                        # row 2 ends early: later regions are padding
    seqs[2, 6:] = PAD_ID
    return seqs, mtp_layout(seqs, k, offset, n_regions, mask_id=MASK_ID, eos_id=EOS_ID, pad_id=PAD_ID)


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_loss_is_zero_at_step_0_with_k1(mode):
    student = tiny_model()
    teacher = frozen_teacher(student)
    _, batch = batch_with_eos(k=1, offset=1, n_regions=4)
    loss, stats = mtp_loss(student, teacher, batch, mode=mode)
    assert abs(loss.item()) < 1e-6 and stats["n_pred"] > 0
    assert stats["acc"] == [1.0]


def test_loss_is_positive_once_the_student_moves():
    student = tiny_model()
    teacher = frozen_teacher(student)
    _, batch = batch_with_eos(k=4)
    for mode in ("hard", "soft"):
        assert mtp_loss(perturbed(student), teacher, batch, mode=mode)[0].item() > 1e-3


def slow_teacher_targets(teacher, seqs, batch, proposals):
    """For every region: teacher over the prefix and guesses 0..k-2, plain causal, positions 0.. -> (B, M, k, V)."""
    B, M, k = proposals.shape
    out = torch.zeros(B, M, k, VOCAB)
    with torch.no_grad():
        for b in range(B):
            for r, e in enumerate(batch.prefix_end.tolist()):
                x = torch.cat([seqs[b, : e + 1], proposals[b, r, : k - 1]])[None]
                out[b, r] = teacher(x)[0, e:]                          # logits after x_e and guesses 0..k-2
    return out


def slow_student_logits(student, seqs, batch):
    """For every region: student over prefix + (k-1) masks, as at inference -> (B, M, k, V)."""
    B, M, k = batch.pred_index.shape
    out = torch.zeros(B, M, k, VOCAB)
    for b in range(B):
        for r, e in enumerate(batch.prefix_end.tolist()):
            x = torch.cat([seqs[b, : e + 1], torch.full((k - 1,), MASK_ID)])[None]
            out[b, r] = student(x)[0, e:]
    return out


def teacher_logits_in_mtp_loss(student, teacher, batch):
    """The logits the teacher returns inside mtp_loss's step 3 -> (B, M, k, V)."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(teacher(*args, **kwargs))
        return seen[-1]

    mtp_loss(student, spy, batch)
    return seen[0].float().view(*batch.pred_index.shape, -1)


@pytest.mark.parametrize("k", [2, 4])
def test_packed_teacher_equals_slow_chain_rule(k):
    teacher = frozen_teacher(tiny_model())
    student = perturbed(teacher)
    seqs, batch = batch_with_eos(k)
    with torch.no_grad():
        proposals = slow_student_logits(student, seqs, batch).argmax(-1)   # (B, M, k)
    assert (proposals != batch.targets).any()                               # not just the ground truth
    packed = teacher_logits_in_mtp_loss(student, teacher, batch)
    slow = slow_teacher_targets(teacher, seqs, batch, proposals)
    valid = batch.valid
    torch.testing.assert_close(packed[valid], slow[valid], atol=1e-5, rtol=0)
    # the teacher input holds the proposals in the slots and nothing else changed
    filled = teacher_input(batch, proposals)
    slots = batch.pred_index[:, :, 1:].flatten(1)                          # (B, M*(k-1))
    real = batch.kind.gather(1, slots) != PAD                               # padded regions stay padding
    assert torch.equal(filled.gather(1, slots)[real], proposals[:, :, :-1].flatten(1)[real])
    assert (filled.gather(1, slots)[~real] == PAD_ID).all() and (~real).any()
    others = torch.ones_like(filled, dtype=torch.bool).scatter(1, slots, False)
    assert torch.equal(filled[others], batch.input_ids[others])


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_distillation_loss_equals_slow_reference(mode):
    teacher = frozen_teacher(tiny_model())
    student = perturbed(teacher)
    seqs, batch = batch_with_eos(k=3)
    loss, stats = mtp_loss(student, teacher, batch, mode=mode)
    s = slow_student_logits(student, seqs, batch)
    t = slow_teacher_targets(teacher, seqs, batch, s.argmax(-1))
    valid = batch.valid
    s, t = s[valid], t[valid]                                               # (n_pred, V)
    if mode == "hard":                  # cross-entropy against the teacher's argmax, minus the teacher's own
        y = t.argmax(-1)
        per = F.cross_entropy(s, y, reduction="none") - F.cross_entropy(t, y, reduction="none")
    else:                               # KL(teacher || student)
        per = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(loss, per.mean(), atol=1e-5, rtol=0)
    assert stats["n_pred"] == int(valid.sum()) and len(stats["acc"]) == 3


def test_gt_mode_targets_are_the_ground_truth():
    student = tiny_model()
    seqs, batch = batch_with_eos(k=3)
    loss, _ = mtp_loss(student, None, batch, mode="gt")
    # the targets are the next k ground-truth tokens, EOS after the EOS
    for b, eos in enumerate([16, 12, 5]):
        for r, e in enumerate(batch.prefix_end.tolist()):
            for j in range(3):
                t = e + 1 + j
                assert batch.valid[b, r, j] == (e < eos and (t < 16 or eos < 16))
                if batch.valid[b, r, j]:
                    assert batch.targets[b, r, j].item() == (seqs[b, t].item() if t <= eos else EOS_ID)
    s = slow_student_logits(student, seqs, batch)
    ce = F.cross_entropy(s[batch.valid], batch.targets[batch.valid])
    torch.testing.assert_close(loss, ce, atol=1e-5, rtol=0)


def test_prefix_ntp_loss_is_ordinary_next_token_cross_entropy():
    student = tiny_model()
    teacher = frozen_teacher(student)
    seqs, batch = batch_with_eos(k=1, offset=1, n_regions=4)
    loss, stats = mtp_loss(student, teacher, batch, mode="hard", prefix_ntp_weight=0.5)
    plain = student(seqs)[:, :-1]                                           # (B, N-1, V)
    ntp = F.cross_entropy(plain[batch.ntp_valid], seqs[:, 1:][batch.ntp_valid])
    torch.testing.assert_close(loss, 0.5 * ntp, atol=1e-5, rtol=0)          # the MTP part is 0 here
    assert abs(stats["ntp_loss"] - ntp.item()) < 1e-5


@pytest.mark.parametrize("mode", ["hard", "soft", "gt"])
def test_gradient_flows_only_into_the_student(mode):
    teacher = frozen_teacher(tiny_model())
    student = perturbed(teacher)
    _, batch = batch_with_eos(k=3)
    loss, _ = mtp_loss(student, teacher, batch, mode=mode)
    loss.backward()
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters())
    assert sum(p.grad.abs().sum() for p in student.parameters()) > 0
    assert not teacher.training
