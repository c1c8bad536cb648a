"""The packed training layout of multi-token prediction (MTP): one row of ground truth
becomes M independent MTP problems, each a prefix followed by k-1 <mask> slots, with the
positions, the attention mask and the targets that make one forward pass train all of them.

What fills the rows lives elsewhere: the toy tasks in tasks/toy.py, the word problems in
tasks/word_problems.py, tokenizers and prompt formats in mtp/tokenizer.py."""
from dataclasses import dataclass

import torch


# A row of N ground-truth tokens packs M independent MTP problems
# ("regions"). Region r's prefix ends at original index e_r = o + r R
# (R = N // M, offset o in [0, R)), and k-1 <mask> slots follow it.
#
# The index convention, the same in every file: a region's k predictions
# are numbered j = 0 .. k-1, and prediction j guesses the token j + 1
# places after the prefix (original index e_r + 1 + j). Prediction 0 is
# read at the last prefix token: the ordinary next token. Prediction
# j >= 1 is read at mask slot j, which sits at position e_r + j: the place
# of the token that prediction j-1 guesses. For the prefix "a b c" (e_r = 2)
# followed by "d e f", with k = 3:
#
#     prediction 0   at c        (position 2)   guesses d
#     prediction 1   at slot 1   (position 3)   guesses e
#     prediction 2   at slot 2   (position 4)   guesses f
#
# The teacher's input (distill.py) puts the student's guess of prediction
# j-1 into slot j, so prediction j sees the prefix and guesses 0 .. j-1.
#
# The tokens the slots stand for follow as COPIES at their own positions,
# so ground truth keeps its ordinary context. The first EOS, at index
# E >= 1 (Qwen rows start with one), ends a row: region r is supervised
# iff e_r < E, targets after E are EOS, and the rest is padding (no loss,
# unseen, seeing only itself so that each softmax row is defined).
# Without an EOS a target past N - 1 is unsupervised. L = N + M (k - 1).

# token kinds in the packed layout
GT = 0
MASK = 1
COPY = 2
PAD = 3


@dataclass
class MTPBatch:
    """What one MTP training step needs: B rows packed to length L, each
    with M regions of k predictions."""

    # (B, L) long: ground truth, k-1 mask slots after each e_r, padding
    input_ids: torch.Tensor
    # (B, L) long: the original index of ground truth; slot j: e_r + j
    positions: torch.Tensor
    # (B, L, L) bool: True = the query (row) may attend to the key (column)
    attn_mask: torch.Tensor
    # (B, L) long: GT / MASK / COPY / PAD
    kind: torch.Tensor

    # (B, M, k) long: the packed index of prediction j of region r
    pred_index: torch.Tensor
    # (B, M, k) long: the ground-truth token prediction j should produce
    targets: torch.Tensor
    # (B, M, k) bool: the prediction is supervised
    valid: torch.Tensor

    # (B, N) long: the packed index of ground-truth token i (original index i)
    gt_index: torch.Tensor
    # (B, N-1) long: the next ground-truth token (tokens 1 .. N-1)
    ntp_targets: torch.Tensor
    # (B, N-1) bool: the next token is real (not after the EOS)
    ntp_valid: torch.Tensor

    # (M,) long: the original index e_r of each region's last prefix token
    prefix_end: torch.Tensor
    k: int
    offset: int
    region_len: int

    def to(self, device) -> "MTPBatch":
        return MTPBatch(**{f: v.to(device) if torch.is_tensor(v) else v
                           for f, v in vars(self).items()})


def mtp_layout(seqs: torch.Tensor, k: int, offset: int, n_regions: int,
               mask_id: int, eos_id=None, pad_id: int = 0,
               trained: torch.Tensor | None = None) -> MTPBatch:
    """Pack ground-truth rows (B, N) into M = n_regions MTP problems each.

    `eos_id`: an int, a list of ints (any of them ends a row) or None.
    `trained` (B, N) bool: which tokens may be targets (answers, say, not
    prompts; a target after the EOS counts as the EOS).
    Example: N = 12, k = 3, M = 2 (R = 6), offset 2, so e = (2, 8); kinds
    G/M/C = ground truth / mask slot / copy; `r.j` = prediction j of
    region r, above the token it must produce:

        idx       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
        token     a   b   c   M   M   d   e   f   g   h   i   M   M   j   k   l
        pos       0   1   2   3   4   3   4   5   6   7   8   9  10   9  10  11
        kind      G   G   G   M   M   C   C   G   G   G   G   M   M   C   C   G
        pred            0.0 0.1 0.2                     1.0 1.1 1.2
        target            d   e   f                       j   k   l

    The mask at index 3 sees a b c and itself; the one at index 4 sees
    a b c, index 3 and itself; d (index 5) sees a b c d.
    """
    B, N = seqs.shape
    device = seqs.device
    M = n_regions
    R = N // n_regions
    # mask slots per region
    n_slots = k - 1
    if not 1 <= M <= N:
        raise ValueError(f"need 1 <= n_regions <= seq_len, "
                         f"got n_regions={M}, seq_len={N}")
    if not 0 <= offset < R:
        raise ValueError(f"need 0 <= offset < seq_len // n_regions = {R}, "
                         f"got offset={offset}")

    # 1. Where everything lands, the same in every row: ground-truth token
    # i moves right by n_slots for every prefix end before it.
    ends = offset + R * torch.arange(M, device=device)        # (M,) the e_r
    L = N + M * n_slots
    # (N,) the original index of each ground-truth token
    orig = torch.arange(N, device=device)
    gt_index = orig + n_slots * (orig[:, None] > ends[None, :]).sum(1)   # (N,)
    # prediction 0 at e_r, prediction j >= 1 at slot j right after it
    pred_index = gt_index[ends][:, None] + torch.arange(k, device=device)  # (M, k)
    slot_index = pred_index[:, 1:]                             # (M, n_slots)
    # prediction j guesses token e_r + 1 + j; slot j stands for the token
    # prediction j-1 guesses, at that token's position
    target_idx = ends[:, None] + 1 + torch.arange(k, device=device)   # (M, k)
    stands_for = target_idx[:, :-1]                            # (M, n_slots)

    input_ids = torch.full((B, L), mask_id, dtype=torch.long, device=device)
    input_ids[:, gt_index] = seqs
    # copies keep their original positions
    positions = torch.zeros(L, dtype=torch.long, device=device)
    positions[gt_index] = orig
    positions[slot_index] = stands_for
    kind = torch.full((L,), GT, device=device)                 # (L,) long
    kind[slot_index] = MASK
    kind[gt_index[stands_for[stands_for < N]]] = COPY

    # 2. Attention before padding: a ground-truth query sees the ground
    # truth up to its own original index; a slot of region r sees the
    # ground truth up to e_r and its own block up to itself.
    # (L,) the region of a slot, -1 elsewhere
    slot_region = torch.full((L,), -1, device=device)
    slot_region[slot_index] = torch.arange(M, device=device)[:, None]
    is_slot = slot_region >= 0
    # (L,) per query
    sees_up_to = torch.where(is_slot, ends[slot_region.clamp(min=0)], positions)
    # (L query, L key)
    sees_gt = ~is_slot[None, :] & (positions[None, :] <= sees_up_to[:, None])
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    same_region = slot_region[:, None] == slot_region[None, :]
    own_block = is_slot[:, None] & same_region & causal

    # 3. Targets: the tokens at target_idx, up to where each row's text ends
    targets, valid, ntp_valid, E = end_of_text(seqs, ends, target_idx, eos_id, trained)

    # 4. Padding: ground truth after the EOS and the blocks of unsupervised
    # regions (e_r >= E). Nobody sees padding; padding sees only itself.
    is_pad = torch.zeros(B, L, dtype=torch.bool, device=device)
    is_pad[:, gt_index] = orig[None, :] > E[:, None]
    is_pad[:, slot_index] = (ends[None, :] >= E[:, None])[:, :, None]
    seen = (sees_gt | own_block)[None]
    attn_mask = seen & ~is_pad[:, None, :] & ~is_pad[:, :, None]   # (B, L, L)
    itself = torch.eye(L, dtype=torch.bool, device=device)
    attn_mask |= itself[None] & is_pad[:, :, None]

    # the same for every row -> (B, ...)
    def rows(x):
        return x[None].expand(B, *x.shape).contiguous()

    return MTPBatch(input_ids=torch.where(is_pad, pad_id, input_ids),
                    positions=rows(positions),
                    attn_mask=attn_mask,
                    kind=torch.where(is_pad, PAD, kind[None]),
                    pred_index=rows(pred_index),
                    targets=targets,
                    valid=valid,
                    gt_index=rows(gt_index),
                    ntp_targets=seqs[:, 1:],
                    ntp_valid=ntp_valid,
                    prefix_end=ends,
                    k=k,
                    offset=offset,
                    region_len=R)


def end_of_text(seqs: torch.Tensor, ends: torch.Tensor, target_idx: torch.Tensor,
                eos_id=None, trained: torch.Tensor | None = None) -> tuple:
    """mtp_layout's end-of-text rules: (targets (B, M, k), valid (B, M, k),
    ntp_valid (B, N-1), E (B,)) for rows `seqs` (B, N), prefix ends `ends`
    (M,) and target indices `target_idx` (M, k).

    E is the index of a row's first EOS, or N without one; index 0 never
    counts (Qwen rows start with an EOS). Region r is supervised iff
    e_r < E. A target after the EOS is the EOS, read from `trained` there
    too; without an EOS a target past N - 1 is unsupervised."""
    B, N = seqs.shape
    orig = torch.arange(N, device=seqs.device)
    if eos_id is None:
        is_eos = torch.zeros(B, N, dtype=torch.bool, device=seqs.device)
    else:
        eos_ids = torch.as_tensor(eos_id, device=seqs.device).reshape(-1)
        is_eos = (seqs[..., None] == eos_ids).any(-1)          # (B, N)
    is_eos[:, 0] = False
    E = torch.where(is_eos, orig, N).min(1).values             # (B,)
    has_eos = E < N
    # (B,) the EOS, or the last token of a row without one
    last = E.clamp(max=N - 1)
    targets = seqs[:, target_idx.clamp(max=N - 1)]             # (B, M, k)
    eos_tok = seqs.gather(1, last[:, None])                    # (B, 1)
    after_eos = (target_idx[None] > E[:, None, None]) & has_eos[:, None, None]
    targets = torch.where(after_eos, eos_tok[:, :, None], targets)
    supervised_region = ends[None, :] < E[:, None]             # (B, M)
    # inside the row, or after its EOS
    in_text = (target_idx[None] < N) | has_eos[:, None, None]  # (B, M, k)
    valid = supervised_region[:, :, None] & in_text
    ntp_valid = orig[None, 1:] <= E[:, None]
    if trained is not None:
        # a target after the EOS is the EOS: `trained` is read there
        target_at = torch.minimum(target_idx[None], last[:, None, None])   # (B, M, k)
        valid = valid & trained.gather(1, target_at.flatten(1)).view_as(valid)
        ntp_valid = ntp_valid & trained[:, 1:]
    return targets, valid, ntp_valid, E


def default_n_regions(seq_len: int, k_max: int) -> int:
    """The paper's M = N / (2 k_max): each window stays clear of the next
    prefix end."""
    return max(1, seq_len // (2 * k_max))


def sample_k_and_offset(k_max: int, region_len: int,
                        generator: torch.Generator | None = None) -> tuple[int, int]:
    """k uniform in [2, k_max] and, INDEPENDENTLY, the offset uniform in
    [0, region_len)."""
    k = int(torch.randint(2, k_max + 1, (1,), generator=generator))
    return k, int(torch.randint(0, region_len, (1,), generator=generator))


def random_mtp_layout(seqs: torch.Tensor, k_max: int, mask_id: int,
                      eos_id=None, pad_id: int = 0, n_regions=None,
                      generator: torch.Generator | None = None,
                      trained: torch.Tensor | None = None) -> MTPBatch:
    """One training step's layout: the paper's M regions, k and offset
    drawn independently."""
    n_regions = n_regions or default_n_regions(seqs.shape[1], k_max)
    region_len = seqs.shape[1] // n_regions
    k, offset = sample_k_and_offset(k_max, region_len, generator)
    return mtp_layout(seqs, k=k, offset=offset, n_regions=n_regions,
                      mask_id=mask_id, eos_id=eos_id, pad_id=pad_id,
                      trained=trained)
