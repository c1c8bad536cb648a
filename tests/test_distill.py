"""The MTP losses (distill.py): zero for a student that is the teacher, equal to slow references.

The slow references below spell the method out region by region with plain causal forwards
and no layout at all; the packed implementation must agree with them.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from data import PAD, mtp_layout
from distill import frozen_teacher, mtp_loss, teacher_input

VOCAB, MASK_ID, EOS_ID, PAD_ID = 50, 49, 1, 0

# Where each row of `batch_with_eos` ends: row 0 has no EOS (16 is past its end).
ROW_ENDS = [16, 12, 5]


def perturbed(model, seed=1, scale=0.05):
    """A trainable copy of `model` with noisy weights: its guesses differ from the teacher's."""
    other = tiny_model(VOCAB)
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def batch_with_eos(k, offset=2, n_regions=2, N=16):
    """Three rows of 16 tokens: one without an EOS, one that ends late, one that ends early."""
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(2, MASK_ID, (3, N), generator=g)
    # row 1 ends in the last region
    seqs[1, 12] = EOS_ID
    seqs[1, 13:] = PAD_ID
    # row 2 ends early: its later regions are padding
    seqs[2, 5] = EOS_ID
    seqs[2, 6:] = PAD_ID
    batch = mtp_layout(seqs, k, offset, n_regions, mask_id=MASK_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    return seqs, batch


# ----------------------------------------------------------------------------------------------
# Slow references: one region at a time, plain causal forwards
# ----------------------------------------------------------------------------------------------

def slow_teacher_targets(teacher, seqs, batch, proposals):
    """Per region: the teacher over the prefix and guesses 0..k-2 -> (B, M, k, V).

    Plain causal attention and positions 0, 1, ...: what the teacher says after the prefix
    and the student's guesses 0 .. j-1, for every prediction j."""
    B, M, k = proposals.shape
    out = torch.zeros(B, M, k, VOCAB)
    ends = batch.prefix_end.tolist()
    with torch.no_grad():
        for b in range(B):
            for r, e in enumerate(ends):
                prefix = seqs[b, : e + 1]
                guesses = proposals[b, r, : k - 1]
                x = torch.cat([prefix, guesses])[None]
                # the logits after x_e and after guesses 0..k-2
                out[b, r] = teacher(x)[0, e:]
    return out


def slow_student_logits(student, seqs, batch):
    """Per region: the student over the prefix and k-1 masks, as at inference -> (B, M, k, V)."""
    B, M, k = batch.pred_index.shape
    out = torch.zeros(B, M, k, VOCAB)
    ends = batch.prefix_end.tolist()
    masks = torch.full((k - 1,), MASK_ID)
    for b in range(B):
        for r, e in enumerate(ends):
            x = torch.cat([seqs[b, : e + 1], masks])[None]
            out[b, r] = student(x)[0, e:]
    return out


def slow_teacher_chain(teacher, seqs, batch):
    """Per region: the teacher continues the prefix greedily for k tokens -> (B, M, k, V).

    Step j's logits come after the prefix and the teacher's own greedy tokens 0 .. j-1."""
    B, M, k = batch.pred_index.shape
    out = torch.zeros(B, M, k, VOCAB)
    ends = batch.prefix_end.tolist()
    with torch.no_grad():
        for b in range(B):
            for r, e in enumerate(ends):
                x = seqs[b, : e + 1]
                for j in range(k):
                    logits = teacher(x[None])[0, -1]
                    out[b, r, j] = logits
                    x = torch.cat([x, logits.argmax()[None]])
    return out


def student_saying(logits):
    """A student that answers every packed batch with these logits (B, M, k, V)."""

    def student(input_ids, positions, attn_mask, output_index):
        return logits.flatten(1, 2)                          # (B, M*k, V)

    return student


def teacher_logits_in_mtp_loss(student, teacher, batch):
    """The logits the teacher returns inside mtp_loss's step 3 -> (B, M, k, V)."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(teacher(*args, **kwargs))
        return seen[-1]

    mtp_loss(student, spy, batch)
    return seen[0].float().view(*batch.pred_index.shape, -1)


# ----------------------------------------------------------------------------------------------
# Where the loss is zero, and where it is not
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_smoke_loss_is_zero_at_step_0_with_k1(mode):
    # A smoke test: with k = 1 there are no slots, so the teacher's input and weights are
    # the student's and any loss that compares the two is zero.
    student = tiny_model(VOCAB)
    teacher = frozen_teacher(student)
    _, batch = batch_with_eos(k=1, offset=1, n_regions=4)
    loss, stats = mtp_loss(student, teacher, batch, mode=mode)
    assert stats["n_pred"] > 0
    assert abs(loss.item()) < 1e-6


def test_smoke_student_agrees_with_the_teacher_at_step_0_with_k1():
    student = tiny_model(VOCAB)
    teacher = frozen_teacher(student)
    _, batch = batch_with_eos(k=1, offset=1, n_regions=4)
    _, stats = mtp_loss(student, teacher, batch)
    assert stats["acc"] == [1.0]


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_loss_is_zero_for_a_student_that_finishes_the_teachers_chain(mode):
    # A student that has started down one branch is taught to finish it: the target of
    # prediction j is what the teacher says after the student's own guesses 0 .. j-1.
    # A student that already says exactly that has nothing left to learn.
    teacher = frozen_teacher(tiny_model(VOCAB))
    seqs, batch = batch_with_eos(k=3)
    chain = slow_teacher_chain(teacher, seqs, batch)         # (B, M, k, V)
    # the chain is not the text: a loss that taught the ground truth would not be zero
    guesses = chain.argmax(-1)
    assert (guesses != batch.targets)[batch.valid].any()
    student = student_saying(chain)
    loss, stats = mtp_loss(student, teacher, batch, mode=mode)
    assert stats["n_pred"] == int(batch.valid.sum())
    assert abs(loss.item()) < 1e-5


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_loss_is_positive_once_the_student_moves(mode):
    student = tiny_model(VOCAB)
    teacher = frozen_teacher(student)
    _, batch = batch_with_eos(k=4)
    loss, _ = mtp_loss(perturbed(student), teacher, batch, mode=mode)
    assert loss.item() > 1e-3


# ----------------------------------------------------------------------------------------------
# The packed teacher and its input
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 4])
def test_packed_teacher_equals_slow_chain_rule(k):
    teacher = frozen_teacher(tiny_model(VOCAB))
    student = perturbed(teacher)
    seqs, batch = batch_with_eos(k)
    with torch.no_grad():
        proposals = slow_student_logits(student, seqs, batch).argmax(-1)   # (B, M, k)
    # the guesses are not just the ground truth
    assert (proposals != batch.targets).any()
    packed = teacher_logits_in_mtp_loss(student, teacher, batch)
    slow = slow_teacher_targets(teacher, seqs, batch, proposals)
    valid = batch.valid
    torch.testing.assert_close(packed[valid], slow[valid], atol=1e-5, rtol=0)


def slots_of(batch):
    """The packed index of every mask slot, and whether it is a real slot (not padding)."""
    slots = batch.pred_index[:, :, 1:].flatten(1)            # (B, M*(k-1))
    real = batch.kind.gather(1, slots) != PAD
    return slots, real


def random_proposals(batch):
    g = torch.Generator().manual_seed(2)
    return torch.randint(2, MASK_ID, batch.pred_index.shape, generator=g)


def test_teacher_input_holds_the_guesses_in_the_slots():
    _, batch = batch_with_eos(k=4)
    proposals = random_proposals(batch)
    filled = teacher_input(batch, proposals)
    slots, real = slots_of(batch)
    # slot j holds the guess of prediction j-1; the last guess is never fed
    fed = proposals[:, :, :-1].flatten(1)                    # (B, M*(k-1))
    assert torch.equal(filled.gather(1, slots)[real], fed[real])


def test_teacher_input_keeps_padded_slots_padding():
    _, batch = batch_with_eos(k=4)
    filled = teacher_input(batch, random_proposals(batch))
    slots, real = slots_of(batch)
    padded = ~real
    # row 2 ends early: its last region is padding
    assert padded.any()
    assert (filled.gather(1, slots)[padded] == PAD_ID).all()


def test_teacher_input_changes_nothing_but_the_slots():
    _, batch = batch_with_eos(k=4)
    filled = teacher_input(batch, random_proposals(batch))
    slots, _ = slots_of(batch)
    others = torch.ones_like(filled, dtype=torch.bool).scatter(1, slots, False)
    assert torch.equal(filled[others], batch.input_ids[others])


# ----------------------------------------------------------------------------------------------
# The loss, against the slow references
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_distillation_loss_equals_slow_reference(mode):
    teacher = frozen_teacher(tiny_model(VOCAB))
    student = perturbed(teacher)
    seqs, batch = batch_with_eos(k=3)
    loss, _ = mtp_loss(student, teacher, batch, mode=mode)
    student_logits = slow_student_logits(student, seqs, batch)
    guesses = student_logits.argmax(-1)
    teacher_logits = slow_teacher_targets(teacher, seqs, batch, guesses)
    s = student_logits[batch.valid]                          # (n_pred, V)
    t = teacher_logits[batch.valid]                          # (n_pred, V)
    if mode == "hard":
        # cross-entropy against the teacher's argmax, minus the teacher's own
        y = t.argmax(-1)
        per = F.cross_entropy(s, y, reduction="none") - F.cross_entropy(t, y, reduction="none")
    else:
        # KL(teacher || student)
        kl = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none")
        per = kl.sum(-1)
    torch.testing.assert_close(loss, per.mean(), atol=1e-5, rtol=0)


def test_stats_count_the_valid_predictions_and_report_accuracy_per_prediction():
    teacher = frozen_teacher(tiny_model(VOCAB))
    _, batch = batch_with_eos(k=3)
    _, stats = mtp_loss(perturbed(teacher), teacher, batch)
    assert stats["n_pred"] == int(batch.valid.sum())
    assert len(stats["acc"]) == 3


def test_gt_targets_are_the_next_k_tokens_then_the_eos():
    k = 3
    seqs, batch = batch_with_eos(k)
    for b, eos in enumerate(ROW_ENDS):
        for r, e in enumerate(batch.prefix_end.tolist()):
            for j in range(k):
                t = e + 1 + j
                # supervised: the prefix is before the EOS, and the target in the row or EOS
                supervised = e < eos and (t < 16 or eos < 16)
                assert batch.valid[b, r, j] == supervised
                if supervised:
                    want = seqs[b, t].item() if t <= eos else EOS_ID
                    assert batch.targets[b, r, j].item() == want


def test_gt_loss_is_cross_entropy_against_the_ground_truth():
    student = tiny_model(VOCAB)
    seqs, batch = batch_with_eos(k=3)
    loss, _ = mtp_loss(student, None, batch, mode="gt")
    logits = slow_student_logits(student, seqs, batch)
    ce = F.cross_entropy(logits[batch.valid], batch.targets[batch.valid])
    torch.testing.assert_close(loss, ce, atol=1e-5, rtol=0)


def prefix_ntp(student, seqs, batch):
    """Plain next-token cross-entropy over the ground truth, up to each row's EOS."""
    plain = student(seqs)[:, :-1]                            # (B, N-1, V)
    targets = seqs[:, 1:]
    return F.cross_entropy(plain[batch.ntp_valid], targets[batch.ntp_valid])


def test_prefix_ntp_loss_is_ordinary_next_token_cross_entropy():
    student = tiny_model(VOCAB)
    teacher = frozen_teacher(student)
    # k = 1 at step 0: the MTP part is 0, what remains is the prefix loss
    seqs, batch = batch_with_eos(k=1, offset=1, n_regions=4)
    loss, _ = mtp_loss(student, teacher, batch, mode="hard", prefix_ntp_weight=0.5)
    ntp = prefix_ntp(student, seqs, batch)
    torch.testing.assert_close(loss, 0.5 * ntp, atol=1e-5, rtol=0)


def test_stats_report_the_prefix_ntp_loss_unweighted():
    student = tiny_model(VOCAB)
    teacher = frozen_teacher(student)
    seqs, batch = batch_with_eos(k=1, offset=1, n_regions=4)
    _, stats = mtp_loss(student, teacher, batch, mode="hard", prefix_ntp_weight=0.5)
    ntp = prefix_ntp(student, seqs, batch)
    assert abs(stats["ntp_loss"] - ntp.item()) < 1e-5


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------

def backward_once(mode):
    """A perturbed student and its frozen teacher, after one backward pass of the loss."""
    teacher = frozen_teacher(tiny_model(VOCAB))
    student = perturbed(teacher)
    _, batch = batch_with_eos(k=3)
    loss, _ = mtp_loss(student, teacher, batch, mode=mode)
    loss.backward()
    return student, teacher


@pytest.mark.parametrize("mode", ["hard", "soft", "gt"])
def test_no_gradient_reaches_the_teacher(mode):
    _, teacher = backward_once(mode)
    for p in teacher.parameters():
        assert not p.requires_grad
        assert p.grad is None


@pytest.mark.parametrize("mode", ["hard", "soft", "gt"])
def test_every_student_weight_gets_a_gradient(mode):
    student, _ = backward_once(mode)
    grads = [p.grad for p in student.parameters()]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_the_frozen_teacher_is_in_eval_mode():
    teacher = frozen_teacher(tiny_model(VOCAB))
    assert not teacher.training
