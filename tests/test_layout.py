"""The packed MTP training layout (data.mtp_layout): what each token sees, where it sits, what is predicted.

The strongest checks run a tiny random transformer over the packed batch and compare with
plain causal forwards over the unpacked sequences: the packing must be invisible to every
ground-truth token, and each mask slot must behave exactly as at inference time.
"""
import os
import sys

import pytest
import torch

from data import COPY, GT, MASK, PAD, default_n_regions, mtp_layout, random_mtp_layout, sample_k_and_offset
from model import ModelConfig, Transformer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import show_layout  # noqa: E402
from show_layout import layout_table, plot_attention_mask  # noqa: E402

VOCAB, MASK_ID, EOS_ID, PAD_ID = 50, 49, 1, 0


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    return Transformer(cfg).eval()


def random_seqs(B, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, MASK_ID, (B, N), generator=g)      # no EOS, pad or mask among them


def layout(seqs, k, offset, n_regions):
    return mtp_layout(seqs, k, offset, n_regions, mask_id=MASK_ID, eos_id=EOS_ID, pad_id=PAD_ID)


CASES = [(1, 0, 3), (2, 3, 3), (3, 0, 2), (4, 5, 2), (4, 7, 2), (6, 1, 1)]   # (k, offset, n_regions), N = 16


def test_docstring_example_is_what_the_code_does():
    batch = mtp_layout(torch.arange(12)[None], k=3, offset=2, n_regions=2, mask_id=99)
    table = layout_table(batch, token_str=lambda t: "abcdefghijkl"[t])
    for line in table.splitlines():
        assert line.rstrip() in mtp_layout.__doc__


def slow_reference(N, k, offset, n_regions):
    """Build the layout token by token with Python lists: (kind, original index or (r, j)) per slot."""
    R = N // n_regions
    ends = [offset + r * R for r in range(n_regions)]
    slots = []
    for i in range(N):
        slots.append(("gt", i))
        if i in ends:
            slots += [("mask", (ends.index(i), j)) for j in range(1, k)]
    return slots, ends


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_ids_positions_and_mask_match_a_slow_reference(k, offset, n_regions):
    N = 16
    seqs = random_seqs(2, N)
    batch = layout(seqs, k, offset, n_regions)
    slots, ends = slow_reference(N, k, offset, n_regions)
    L = len(slots)
    assert batch.input_ids.shape == (2, L) and batch.attn_mask.shape == (2, L, L)
    for q, (what, where) in enumerate(slots):
        if what == "gt":
            assert torch.equal(batch.input_ids[:, q], seqs[:, where])
            assert (batch.positions[:, q] == where).all()          # copies keep their original position
            allowed = {s for s, (w, i) in enumerate(slots) if w == "gt" and i <= where}
        else:
            r, j = where
            assert (batch.input_ids[:, q] == MASK_ID).all()        # one mask id in every slot
            assert (batch.positions[:, q] == ends[r] + j).all()
            allowed = {s for s, (w, i) in enumerate(slots)
                       if (w == "gt" and i <= ends[r]) or (w == "mask" and i[0] == r and i[1] <= j)}
        expected = torch.tensor([s in allowed for s in range(L)])
        assert torch.equal(batch.attn_mask[0, q], expected), (q, what, where)
    # predictions: the last prefix token, then the slots of its block
    for r, e in enumerate(ends):
        want = [slots.index(("gt", e))] + [slots.index(("mask", (r, j))) for j in range(1, k)]
        assert batch.pred_index[0, r].tolist() == want
        in_seq = [t for t in range(e + 1, e + 1 + k) if t < N]
        assert batch.targets[0, r, : len(in_seq)].tolist() == seqs[0, in_seq].tolist()
        assert batch.valid[0, r].tolist() == [t < N for t in range(e + 1, e + 1 + k)]


def test_copies_are_marked_and_keep_positions():
    batch = layout(random_seqs(1, 16), k=4, offset=2, n_regions=2)       # ends 2, 10
    kinds = batch.kind[0]
    copies = (kinds == COPY).nonzero().squeeze(1)
    assert batch.positions[0, copies].tolist() == [3, 4, 5, 11, 12, 13]
    assert (kinds == MASK).sum() == 6 and (kinds == PAD).sum() == 0
    # a copy at position p comes right after the block whose slot j also has position p
    assert batch.positions[0, copies].tolist() == batch.positions[0, kinds == MASK].tolist()


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_ground_truth_logits_equal_a_plain_forward(k, offset, n_regions):
    model = tiny_model()
    seqs = random_seqs(2, 16)
    batch = layout(seqs, k, offset, n_regions)
    with torch.no_grad():
        plain = model(seqs)                                                  # (B, N, V) causal, positions 0..N-1
        packed = model(batch.input_ids, batch.positions, batch.attn_mask)    # (B, L, V)
    gt = (batch.kind[0] == GT) | (batch.kind[0] == COPY)
    torch.testing.assert_close(packed[:, gt], plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_slot_logits_equal_inference_and_ignore_everything_else(k, offset, n_regions):
    model = tiny_model()
    seqs = random_seqs(1, 16)
    batch = layout(seqs, k, offset, n_regions)
    with torch.no_grad():
        packed = model(batch.input_ids, batch.positions, batch.attn_mask)[0]  # (L, V)
        for r, e in enumerate(batch.prefix_end.tolist()):
            idx = batch.pred_index[0, r]
            # inference: prefix then k-1 masks, plain causal attention, positions 0..e+k-1
            infer = torch.cat([seqs[0, : e + 1], torch.full((k - 1,), MASK_ID)])[None]
            torch.testing.assert_close(packed[idx], model(infer)[0, e:], atol=1e-5, rtol=0)
            # perturb every token a prediction of this region may not see: the logits do not move
            allowed = batch.attn_mask[0, idx].any(0)                          # union over the k predictions
            noisy = torch.where(allowed, batch.input_ids[0], (batch.input_ids[0] + 7) % MASK_ID)[None]
            moved = model(noisy, batch.positions, batch.attn_mask)[0, idx]
            torch.testing.assert_close(moved, packed[idx], atol=1e-5, rtol=0)
            # ... and changing the first prefix token does move them (the check has teeth)
            poked = batch.input_ids.clone()
            poked[0, 0] = (poked[0, 0] + 1) % MASK_ID
            assert not torch.allclose(model(poked, batch.positions, batch.attn_mask)[0, idx], packed[idx])


def test_eos_ends_supervision_and_pads_the_rest():
    N, k = 16, 3
    seqs = random_seqs(3, N)
    seqs[0, 6] = EOS_ID     # EOS in the stretch of region 0 (ends 2, 10): region 1 is padding
    seqs[0, 7:] = PAD_ID
    seqs[1, 12] = EOS_ID    # EOS in region 1's stretch, after its window 11..13's first token
    seqs[1, 13:] = PAD_ID   # row 2 has no EOS
    batch = layout(seqs, k, offset=2, n_regions=2)
    assert batch.input_ids.shape == (3, N + 2 * (k - 1))                     # one packed length for all rows
    # row 0: region 0 predicts 3,4,5; region 1 unsupervised, its block and everything after EOS padded
    assert batch.valid[0].tolist() == [[True] * 3, [False] * 3]
    pad = batch.kind[0] == PAD
    assert (batch.input_ids[0, pad] == PAD_ID).all()
    assert pad.sum() == (N - 7) + (k - 1)
    assert torch.equal(batch.attn_mask[0][pad], torch.eye(len(pad), dtype=torch.bool)[pad])  # self only
    assert not batch.attn_mask[0][~pad][:, pad].any()                                         # nobody sees pads
    # row 1: region 1 predicts 11, 12 = EOS, 13 -> EOS (after the EOS)
    assert batch.valid[1].all()
    assert batch.targets[1, 1].tolist() == [seqs[1, 11].item(), EOS_ID, EOS_ID]
    # the ntp targets stop at the EOS
    assert batch.ntp_valid[1].tolist() == [i + 1 <= 12 for i in range(N - 1)]
    assert batch.ntp_valid[2].all() and batch.valid[2].all()


def test_eos_at_the_very_start_is_not_an_end():
    seqs = random_seqs(1, 16)
    seqs[0, 0] = EOS_ID                                  # Qwen data begins with its end-of-text token
    assert layout(seqs, 3, 2, 2).valid.all()


def test_window_past_the_sequence_end_is_unsupervised():
    seqs = random_seqs(1, 16)
    batch = layout(seqs, k=4, offset=7, n_regions=2)     # ends 7, 15: region 1 predicts beyond N
    assert batch.valid[0, 0].all() and not batch.valid[0, 1].any()
    seqs[0, 15] = EOS_ID                                  # ... unless the row ended: then the targets are EOS
    batch = layout(seqs, k=4, offset=6, n_regions=2)     # ends 6, 14: predicts 15 (EOS), 16, 17, 18
    assert batch.valid[0, 1].all() and (batch.targets[0, 1] == EOS_ID).all()


def test_trained_limits_the_targets_and_a_target_after_the_eos_counts_as_the_eos():
    seqs = random_seqs(2, 16)
    seqs[1, 12] = EOS_ID
    trained = torch.zeros(2, 16, dtype=torch.bool)
    trained[:, 9:13] = True                              # an "answer" 9..12; row 1 ends at its EOS, 12
    full, part = layout(seqs, 3, 2, 2), mtp_layout(seqs, 3, 2, 2, MASK_ID, EOS_ID, PAD_ID, trained=trained)
    # ends 2, 10: region 0 predicts 3..5 (not trained), region 1 predicts 11, 12, 13
    assert not part.valid[:, 0].any()
    assert part.valid[0, 1].tolist() == [True, True, False]            # 13 is not trained
    assert part.valid[1, 1].tolist() == [True, True, True]             # 13 comes after the EOS: the EOS decides
    assert torch.equal(part.ntp_valid, full.ntp_valid & trained[:, 1:])
    assert torch.equal(part.targets, full.targets) and torch.equal(part.attn_mask, full.attn_mask)


def test_k1_has_no_mask_slots():
    seqs = random_seqs(2, 16)
    batch = layout(seqs, k=1, offset=3, n_regions=4)
    assert torch.equal(batch.input_ids, seqs) and batch.pred_index[0, :, 0].tolist() == [3, 7, 11, 15]
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(batch.attn_mask[0], causal)


def test_k_and_offset_are_drawn_independently():
    k_max, region_len, n = 4, 8, 4000
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(k_max + 1, region_len)
    for _ in range(n):
        k, offset = sample_k_and_offset(k_max, region_len, g)
        counts[k, offset] += 1
    counts = counts[2:]                                   # k in [2, k_max]
    assert (counts > 0).all()                             # every (k, offset) pair occurs
    # chi-square test of independence: 14 degrees of freedom, 99.9% quantile is about 36.1
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / n
    assert ((counts - expected) ** 2 / expected).sum() < 36.1


def test_random_layout_uses_the_papers_region_count():
    assert default_n_regions(160, 16) == 5                # N = 160, k_max = 16 -> regions of 32 tokens
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = random_mtp_layout(random_seqs(2, 32), k_max=4, mask_id=MASK_ID, eos_id=EOS_ID, generator=g)
        assert 2 <= batch.k <= 4 and batch.region_len == 8 and 0 <= batch.offset < 8
        assert batch.pred_index.shape == (2, 4, batch.k) and batch.valid[:, :-1].all()


def test_plot_attention_mask_writes_a_png(tmp_path):
    seqs = random_seqs(1, 12)
    seqs[0, 9] = EOS_ID
    path = tmp_path / "mask.png"
    plot_attention_mask(layout(seqs, k=3, offset=1, n_regions=2), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_layout_script_prints_the_table_and_draws_the_figure(tmp_path, capsys):
    assert show_layout.run_cli(show_layout.show, ["--k", "3", "--png", str(tmp_path / "m.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[:6]] == ["idx", "token", "pos", "kind", "pred", "target"]
    assert table[3].split()[1:].count("M") == 2 * 2                   # two regions of k-1 = 2 slots
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert show_layout.run_cli(show_layout.show, ["--offset", "99", "--png", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.startswith("error: need 0 <= offset < seq_len // n_regions")
