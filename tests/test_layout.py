"""The packed MTP training layout (data.mtp_layout): what each token sees, where it sits, what is
predicted.

The strongest checks run a tiny random transformer over the packed batch and compare with
plain causal forwards over the unpacked sequences: the packing must be invisible to every
ground-truth token, and each mask slot must behave exactly as at inference time.
"""
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from conftest import tiny_model
from data import (COPY, GT, MASK, PAD, default_n_regions, mtp_layout, random_mtp_layout,
                  sample_k_and_offset)
from mtp.plots import layout_table, plot_attention_mask

# The script that shows the layout, run as a user runs it
SHOW_LAYOUT = Path(__file__).resolve().parents[1] / "scripts" / "show_layout.py"

VOCAB, MASK_ID, EOS_ID, PAD_ID = 50, 49, 1, 0

# The rows of most tests: 16 tokens.
N = 16

# (k, offset, n_regions) for rows of N = 16 tokens
CASES = [
    # no mask slots
    (1, 0, 3),
    # three regions of 5, the first prefix ending at 3
    (2, 3, 3),
    (3, 0, 2),
    (4, 5, 2),
    # the last window runs past the row
    (4, 7, 2),
    # one region
    (6, 1, 1),
]


def random_seqs(B, length, seed=0):
    """Random rows with no EOS, padding or mask among their tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, MASK_ID, (B, length), generator=g)


def layout(seqs, k, offset, n_regions):
    ids = {"mask_id": MASK_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
    return mtp_layout(seqs, k, offset, n_regions, **ids)


def assert_same_logits(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# The docstring's example is the code's
# ----------------------------------------------------------------------------------------------

def docstring_table():
    """The example table of mtp_layout's docstring: the indented block that starts with idx."""
    doc = inspect.cleandoc(mtp_layout.__doc__)
    blocks = doc.split("\n\n")
    tables = [b for b in blocks if b.lstrip().startswith("idx")]
    assert len(tables) == 1
    return textwrap.dedent(tables[0]).splitlines()


def test_docstring_example_is_what_the_code_does():
    # the docstring's example: 12 tokens a..l, k = 3, offset 2, two regions
    seqs = torch.arange(12)[None]
    batch = mtp_layout(seqs, k=3, offset=2, n_regions=2, mask_id=99)
    table = layout_table(batch, token_str=lambda t: "abcdefghijkl"[t])
    regenerated = [line.rstrip() for line in table.splitlines()]
    # the whole block, both ways: no row missing, no stale row left over
    assert docstring_table() == regenerated


# ----------------------------------------------------------------------------------------------
# The layout against a slow reference, built slot by slot
# ----------------------------------------------------------------------------------------------

def slow_layout(k, offset, n_regions):
    """The packed row, slot by slot, with Python lists; and the prefix ends e_r.

    A slot is ("gt", i) for ground-truth token i, ("mask", (r, j)) for slot j of region r."""
    R = N // n_regions
    ends = [offset + r * R for r in range(n_regions)]
    slots = []
    for i in range(N):
        slots.append(("gt", i))
        if i in ends:
            r = ends.index(i)
            slots += [("mask", (r, j)) for j in range(1, k)]
    return slots, ends


def slow_position(slot, ends):
    what, where = slot
    # a ground-truth token (a copy too) keeps its original position
    if what == "gt":
        return where
    # mask slot j of region r stands for token e_r + j
    r, j = where
    return ends[r] + j


def slow_sees(query, key, ends):
    """Whether the query slot may attend to the key slot."""
    q_what, q_where = query
    k_what, k_where = key
    # ground truth sees the ground truth up to itself
    if q_what == "gt":
        return k_what == "gt" and k_where <= q_where
    r, j = q_where
    # a mask slot sees its region's prefix ...
    if k_what == "gt":
        return k_where <= ends[r]
    # ... and its own block up to itself
    return k_where[0] == r and k_where[1] <= j


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_ids_match_a_slow_reference(k, offset, n_regions):
    seqs = random_seqs(2, N)
    batch = layout(seqs, k, offset, n_regions)
    slots, _ = slow_layout(k, offset, n_regions)
    # one mask id in every slot
    mask_column = torch.full((2,), MASK_ID)
    columns = [seqs[:, i] if what == "gt" else mask_column for what, i in slots]
    expected = torch.stack(columns, dim=1)                   # (B, L)
    assert torch.equal(batch.input_ids, expected)


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_positions_match_a_slow_reference(k, offset, n_regions):
    batch = layout(random_seqs(2, N), k, offset, n_regions)
    slots, ends = slow_layout(k, offset, n_regions)
    expected = torch.tensor([slow_position(s, ends) for s in slots])
    assert torch.equal(batch.positions, expected.expand(2, -1))


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_attention_mask_matches_a_slow_reference(k, offset, n_regions):
    batch = layout(random_seqs(2, N), k, offset, n_regions)
    slots, ends = slow_layout(k, offset, n_regions)
    L = len(slots)
    rows = [[slow_sees(query, key, ends) for key in slots] for query in slots]
    expected = torch.tensor(rows)                            # (L query, L key)
    assert torch.equal(batch.attn_mask, expected.expand(2, L, L))


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_predictions_are_read_at_the_prefix_end_and_its_slots(k, offset, n_regions):
    batch = layout(random_seqs(2, N), k, offset, n_regions)
    slots, ends = slow_layout(k, offset, n_regions)
    expected = []
    for r, e in enumerate(ends):
        # prediction 0 at the last prefix token, prediction j at slot j
        first = slots.index(("gt", e))
        rest = [slots.index(("mask", (r, j))) for j in range(1, k)]
        expected.append([first, *rest])
    assert torch.equal(batch.pred_index, torch.tensor(expected).expand(2, -1, -1))


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_targets_are_the_next_k_tokens(k, offset, n_regions):
    seqs = random_seqs(2, N)
    batch = layout(seqs, k, offset, n_regions)
    _, ends = slow_layout(k, offset, n_regions)
    for r, e in enumerate(ends):
        in_row = [t for t in range(e + 1, e + 1 + k) if t < N]
        targets = batch.targets[0, r, : len(in_row)]
        assert targets.tolist() == seqs[0, in_row].tolist()


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_targets_past_the_row_are_unsupervised(k, offset, n_regions):
    batch = layout(random_seqs(2, N), k, offset, n_regions)
    _, ends = slow_layout(k, offset, n_regions)
    for r, e in enumerate(ends):
        in_row = [t < N for t in range(e + 1, e + 1 + k)]
        assert batch.valid[0, r].tolist() == in_row


def two_regions_of_k4():
    """One row, k = 4, ends 2 and 10: the slots stand for 3, 4, 5 and 11, 12, 13."""
    return layout(random_seqs(1, N), k=4, offset=2, n_regions=2)


def test_copies_keep_their_original_positions():
    batch = two_regions_of_k4()
    kinds = batch.kind[0]
    copies = (kinds == COPY).nonzero().squeeze(1)
    assert batch.positions[0, copies].tolist() == [3, 4, 5, 11, 12, 13]


def test_each_copy_has_the_position_of_the_slot_that_stands_for_it():
    batch = two_regions_of_k4()
    kinds = batch.kind[0]
    copy_positions = batch.positions[0, kinds == COPY]
    slot_positions = batch.positions[0, kinds == MASK]
    assert copy_positions.tolist() == slot_positions.tolist()


def test_two_regions_of_k4_hold_six_slots_and_no_padding():
    batch = two_regions_of_k4()
    kinds = batch.kind[0]
    assert (kinds == MASK).sum() == 6
    assert (kinds == PAD).sum() == 0


# ----------------------------------------------------------------------------------------------
# The packing is invisible to the model
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_ground_truth_logits_equal_a_plain_forward(k, offset, n_regions):
    model = tiny_model(VOCAB)
    seqs = random_seqs(2, N)
    batch = layout(seqs, k, offset, n_regions)
    with torch.no_grad():
        # causal, positions 0 .. N-1
        plain = model(seqs)                                  # (B, N, V)
        packed = model(batch.input_ids, batch.positions, batch.attn_mask)   # (B, L, V)
    gt = (batch.kind[0] == GT) | (batch.kind[0] == COPY)
    assert_same_logits(packed[:, gt], plain)


def packed_logits(model, batch, input_ids=None):
    """The model over row 0 of the packed batch -> (L, V)."""
    if input_ids is None:
        input_ids = batch.input_ids
    with torch.no_grad():
        return model(input_ids, batch.positions, batch.attn_mask)[0]


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_slot_logits_equal_inference(k, offset, n_regions):
    model = tiny_model(VOCAB)
    seqs = random_seqs(1, N)
    batch = layout(seqs, k, offset, n_regions)
    packed = packed_logits(model, batch)
    masks = torch.full((k - 1,), MASK_ID)
    for r, e in enumerate(batch.prefix_end.tolist()):
        # inference: the prefix then k-1 masks, plain causal attention, positions 0 .. e+k-1
        infer = torch.cat([seqs[0, : e + 1], masks])[None]
        with torch.no_grad():
            expected = model(infer)[0, e:]
        idx = batch.pred_index[0, r]
        assert_same_logits(packed[idx], expected)


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_slot_logits_ignore_every_token_they_may_not_see(k, offset, n_regions):
    model = tiny_model(VOCAB)
    batch = layout(random_seqs(1, N), k, offset, n_regions)
    ids = batch.input_ids[0]
    packed = packed_logits(model, batch)
    for r in range(len(batch.prefix_end)):
        idx = batch.pred_index[0, r]
        # every token that no prediction of this region may see, changed
        allowed = batch.attn_mask[0, idx].any(0)             # (L,) the k predictions' union
        changed = (ids + 7) % MASK_ID
        noisy = torch.where(allowed, ids, changed)[None]
        moved = packed_logits(model, batch, noisy)[idx]
        assert_same_logits(moved, packed[idx])


@pytest.mark.parametrize("k,offset,n_regions", CASES)
def test_slot_logits_move_with_the_first_prefix_token(k, offset, n_regions):
    # the check above has teeth: a token every prediction sees does move them
    model = tiny_model(VOCAB)
    batch = layout(random_seqs(1, N), k, offset, n_regions)
    packed = packed_logits(model, batch)
    poked = batch.input_ids.clone()
    poked[0, 0] = (poked[0, 0] + 1) % MASK_ID
    moved = packed_logits(model, batch, poked)
    for r in range(len(batch.prefix_end)):
        idx = batch.pred_index[0, r]
        assert not torch.allclose(moved[idx], packed[idx])


# ----------------------------------------------------------------------------------------------
# The end of text, and what may be a target
# ----------------------------------------------------------------------------------------------

def eos_batch(k=3):
    """Three rows, ends 2 and 10: EOS in region 0's stretch, in region 1's, and none."""
    seqs = random_seqs(3, N)
    # row 0: EOS at 6, in the stretch of region 0: region 1 is padding
    seqs[0, 6] = EOS_ID
    seqs[0, 7:] = PAD_ID
    # row 1: EOS at 12, in region 1's window 11 .. 13, after its first token
    seqs[1, 12] = EOS_ID
    seqs[1, 13:] = PAD_ID
    # row 2 has no EOS
    return seqs, layout(seqs, k, offset=2, n_regions=2)


def test_rows_that_end_early_pack_to_the_same_length():
    k = 3
    _, batch = eos_batch(k)
    assert batch.input_ids.shape == (3, N + 2 * (k - 1))


def test_regions_after_the_eos_are_unsupervised():
    _, batch = eos_batch()
    # row 0: region 0 predicts 3, 4, 5; region 1 starts after the EOS
    assert batch.valid[0].tolist() == [[True] * 3, [False] * 3]


def test_a_row_without_eos_is_supervised_everywhere():
    _, batch = eos_batch()
    assert batch.valid[2].all()
    assert batch.ntp_valid[2].all()


def test_after_the_eos_every_token_is_padding():
    k = 3
    _, batch = eos_batch(k)
    pad = batch.kind[0] == PAD
    assert (batch.input_ids[0, pad] == PAD_ID).all()
    # the tokens after the EOS (7 .. 15) and region 1's slots
    assert pad.sum() == (N - 7) + (k - 1)


def test_padding_attends_only_to_itself():
    _, batch = eos_batch()
    pad = batch.kind[0] == PAD
    L = len(pad)
    itself = torch.eye(L, dtype=torch.bool)
    assert torch.equal(batch.attn_mask[0][pad], itself[pad])


def test_nothing_attends_to_padding():
    _, batch = eos_batch()
    pad = batch.kind[0] == PAD
    others_rows = batch.attn_mask[0][~pad]                   # (non-padding queries, L)
    assert not others_rows[:, pad].any()


def test_targets_after_the_eos_are_the_eos():
    seqs, batch = eos_batch()
    # row 1: region 1 predicts 11, 12 = EOS, and 13, after the EOS
    assert batch.valid[1].all()
    eleventh = seqs[1, 11].item()
    assert batch.targets[1, 1].tolist() == [eleventh, EOS_ID, EOS_ID]


def test_next_token_targets_stop_at_the_eos():
    _, batch = eos_batch()
    # row 1: the next token of i is real while i + 1 <= 12, the EOS
    expected = [i + 1 <= 12 for i in range(N - 1)]
    assert batch.ntp_valid[1].tolist() == expected


def test_eos_at_the_very_start_is_not_an_end():
    seqs = random_seqs(1, N)
    # Qwen data begins with its end-of-text token
    seqs[0, 0] = EOS_ID
    assert layout(seqs, 3, 2, 2).valid.all()


def test_window_past_the_sequence_end_is_unsupervised():
    # ends 7, 15: region 1 predicts beyond N
    batch = layout(random_seqs(1, N), k=4, offset=7, n_regions=2)
    assert batch.valid[0, 0].all()
    assert not batch.valid[0, 1].any()


def test_window_past_the_end_of_a_finished_row_predicts_the_eos():
    seqs = random_seqs(1, N)
    seqs[0, 15] = EOS_ID
    # ends 6, 14: region 1 predicts 15 (the EOS), then 16, 17, 18, past the row
    batch = layout(seqs, k=4, offset=6, n_regions=2)
    assert batch.valid[0, 1].all()
    assert (batch.targets[0, 1] == EOS_ID).all()


def trained_batches():
    """Rows with an "answer" 9 .. 12, row 1 ending at its EOS, 12: without and with `trained`."""
    seqs = random_seqs(2, N)
    seqs[1, 12] = EOS_ID
    trained = torch.zeros(2, N, dtype=torch.bool)
    trained[:, 9:13] = True
    full = layout(seqs, 3, 2, 2)
    part = mtp_layout(seqs, 3, 2, 2, MASK_ID, EOS_ID, PAD_ID, trained=trained)
    return full, part, trained


def test_only_trained_tokens_are_targets():
    _, part, _ = trained_batches()
    # ends 2, 10: region 0 predicts 3 .. 5, none trained
    assert not part.valid[:, 0].any()
    # region 1 predicts 11, 12, 13: 13 is not trained
    assert part.valid[0, 1].tolist() == [True, True, False]


def test_a_target_after_the_eos_counts_as_the_eos():
    _, part, _ = trained_batches()
    # row 1's 13 comes after its EOS: the EOS, trained, decides
    assert part.valid[1, 1].tolist() == [True, True, True]


def test_only_trained_tokens_are_next_token_targets():
    full, part, trained = trained_batches()
    expected = full.ntp_valid & trained[:, 1:]
    assert torch.equal(part.ntp_valid, expected)


def test_trained_changes_neither_the_targets_nor_the_attention():
    full, part, _ = trained_batches()
    assert torch.equal(part.targets, full.targets)
    assert torch.equal(part.attn_mask, full.attn_mask)


# ----------------------------------------------------------------------------------------------
# k = 1, and drawing k and the offset
# ----------------------------------------------------------------------------------------------

def test_k1_packs_the_row_as_it_is():
    seqs = random_seqs(2, N)
    batch = layout(seqs, k=1, offset=3, n_regions=4)
    assert torch.equal(batch.input_ids, seqs)


def test_k1_reads_its_predictions_at_the_prefix_ends():
    batch = layout(random_seqs(2, N), k=1, offset=3, n_regions=4)
    assert batch.pred_index[0, :, 0].tolist() == [3, 7, 11, 15]


def test_k1_attention_is_plain_causal():
    batch = layout(random_seqs(2, N), k=1, offset=3, n_regions=4)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.equal(batch.attn_mask[0], causal)


def test_k_and_offset_are_drawn_independently():
    k_max = 4
    region_len = 8
    n = 4000
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(k_max + 1, region_len)
    for _ in range(n):
        k, offset = sample_k_and_offset(k_max, region_len, g)
        counts[k, offset] += 1
    # k in [2, k_max]: every (k, offset) pair occurs
    counts = counts[2:]
    assert (counts > 0).all()
    # chi-square test of independence: 14 degrees of freedom, 99.9% quantile about 36.1
    per_k = counts.sum(1, keepdim=True)                      # (k_max - 1, 1)
    per_offset = counts.sum(0, keepdim=True)                 # (1, region_len)
    expected = per_k * per_offset / n
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < 36.1


def test_default_region_count_is_the_papers():
    # N = 160, k_max = 16: regions of 2 k_max = 32 tokens
    assert default_n_regions(160, 16) == 5


def random_layouts(n=20):
    """Layouts of rows of 32 tokens with k_max = 4: four regions of 8."""
    g = torch.Generator().manual_seed(0)
    seqs = random_seqs(2, 32)
    kw = {"mask_id": MASK_ID, "eos_id": EOS_ID, "generator": g}
    return [random_mtp_layout(seqs, k_max=4, **kw) for _ in range(n)]


def test_random_layout_draws_k_and_the_offset_within_a_region():
    for batch in random_layouts():
        assert 2 <= batch.k <= 4
        assert batch.region_len == 8
        assert 0 <= batch.offset < 8


def test_random_layout_has_four_regions_all_but_the_last_supervised():
    for batch in random_layouts():
        assert batch.pred_index.shape == (2, 4, batch.k)
        assert batch.valid[:, :-1].all()


# ----------------------------------------------------------------------------------------------
# The figure, and the script that shows the layout
# ----------------------------------------------------------------------------------------------

# The figure's palette, in kind order: ground truth, mask slot, copy, padding.
KIND_COLOURS = ["#3b75af", "#ef8636", "#519e3e", "#b0b0b0"]

# One cell of the figure: 0.28 inch at 120 dots per inch, squared.
CELL_PIXELS = (0.28 * 120) ** 2


def pixels_of(image, colour):
    """How many pixels of an RGBA image have this colour."""
    rgb = image[..., :3]                                     # (H, W, 3)
    distance = np.abs(rgb - np.array(to_rgb(colour))).max(-1)
    return int((distance < 0.02).sum())


def test_plot_attention_mask_colours_each_attended_cell_by_its_key(tmp_path):
    seqs = random_seqs(1, 12)
    seqs[0, 9] = EOS_ID
    batch = layout(seqs, k=3, offset=1, n_regions=2)
    path = tmp_path / "mask.png"
    plot_attention_mask(batch, path)
    image = imread(path)                                     # (H, W, RGBA)
    sees = batch.attn_mask[0]
    key_kind = batch.kind[0][None, :]
    for kind, colour in enumerate(KIND_COLOURS):
        cells = int((sees & (key_kind == kind)).sum())
        pixels = pixels_of(image, colour)
        # about one cell per attended (query, key) pair; the legend and labels add less than one
        assert 0.5 * cells * CELL_PIXELS < pixels < 1.5 * (cells + 1) * CELL_PIXELS, kind


def show_layout(*argv):
    """Run scripts/show_layout.py as a user does, in a process of its own."""
    command = [sys.executable, str(SHOW_LAYOUT), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """`show_layout.py --k 3`: its finished process and the figure it wrote."""
    png = tmp_path_factory.mktemp("show") / "m.png"
    done = show_layout("--k", "3", "--png", str(png))
    assert done.returncode == 0, done.stderr
    return done, png


def test_show_layout_prints_the_table(shown):
    done, _ = shown
    table = done.stdout.splitlines()
    names = [line.split()[0] for line in table[:6]]
    assert names == ["idx", "token", "pos", "kind", "pred", "target"]
    kinds = table[3].split()[1:]
    # two regions of k-1 = 2 slots
    assert kinds.count("M") == 2 * 2


def test_show_layout_draws_the_figure_of_the_table(shown):
    done, png = shown
    columns = len(done.stdout.splitlines()[0].split()) - 1
    image = imread(png)
    height, width = image.shape[:2]
    # at least one cell of 0.28 inch at 120 dpi per token, both ways
    assert min(height, width) > columns * 0.28 * 120


def test_show_layout_refuses_an_offset_outside_the_region_in_one_line(tmp_path):
    done = show_layout("--offset", "99", "--png", str(tmp_path / "x.png"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: need 0 <= offset < seq_len // n_regions")
    assert len(done.stderr.strip().splitlines()) == 1
