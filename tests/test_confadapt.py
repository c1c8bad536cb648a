"""confadapt.py: every decoding mode against plain greedy and against its uncached definition,
decoded by both cached decoders: confadapt.generate (the lesson's) and mtp.engine.generate (ragged
passes and continuous batching, what every command decodes with).

Two tiny models: a random one (weights scaled up so its argmaxes are well separated) and a toy
MTP model trained here for a few seconds on arithmetic sequences (step 1 or 3, mod 16), so its
mask predictions are often, but not always, right and confident: drafts get accepted and
rejected, and ConfAdapt accepts chunks of varying size.
"""
import contextlib
import copy
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import confadapt
from confadapt import (DecodeConfig, accept_confadapt, generate_uncached, lookup_drafts,
                       verify_drafts)
from conftest import ONE_LAYER, tiny_model
from model import ModelConfig, Transformer, add_mask_token
from mtp.engine import decode_pass, generate, new_cache, prefill
from mtp.hf import from_pretrained, save_pretrained
from mtp.tokenizer import Tokenizer
from tasks.toy import toy_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The random model's mask token, and prompts of different lengths on purpose.
MASK = 31
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4], [20, 21]]

# The toy's 16 tokens, its mask token and its prompts.
TOY_V = 16
TOY_MASK = 16
TOY_PROMPTS = [[3, 4, 5], [9], [0, 3, 6, 9], [5, 6], [7, 10, 13, 0, 3, 6, 9, 12, 15]]

GREEDY = DecodeConfig("static", k=1)

# The modes the definition test decodes with: each kind, at small and large blocks.
EVERY_MODE = [
    GREEDY,
    *[DecodeConfig("static", k=k) for k in (2, 3, 5)],
    DecodeConfig("confadapt", tau=0.3, k_max=4),
    DecodeConfig("confadapt", tau=0.6, k_max=8),
    DecodeConfig("confadapt", tau=0.9, k_max=8),
    DecodeConfig("confadapt", tau=0.99, k_max=16),
    *[DecodeConfig("lossless", k=k) for k in (2, 4, 8)],
    DecodeConfig("lossless", k=4, lookup=True),
]

# One mode of each kind.
MODES = [
    GREEDY,
    DecodeConfig("static", k=3),
    DecodeConfig("confadapt", tau=0.5, k_max=6),
    DecodeConfig("lossless", k=4),
]

# ConfAdapt on the trained toy: it accepts chunks there.
TOY_CONFADAPT = DecodeConfig("confadapt", tau=0.9, k_max=8)

pytestmark = pytest.mark.usefixtures("one_thread")            # conftest.py


def describe(mode):
    return mode.describe()


@pytest.fixture(scope="module")
def random_model(one_thread_for_module):
    model = tiny_model(32, max_seq_len=96, mask_token_id=MASK).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def toy_batch(g):
    """Prompts and targets of x_t = (start + step * t) mod 16: a random prefix and k - 1 masks."""
    start = torch.randint(0, TOY_V, (32, 1), generator=g)
    step = 1 + 2 * torch.randint(0, 2, (32, 1), generator=g)
    # (32, 32)
    seq = (start + step * torch.arange(32)) % TOY_V
    i = int(torch.randint(1, 24, (1,), generator=g))
    k = int(torch.randint(1, 9, (1,), generator=g))
    masks = torch.full((32, k - 1), TOY_MASK)
    x = torch.cat([seq[:, :i], masks], 1)
    # the next token everywhere
    targets = seq[:, 1:i + k]
    return x, targets


@pytest.fixture(scope="module")
def toy_model(one_thread_for_module):
    """A tiny MTP model trained on x_t = (start + step * t) mod 16, step 1 or 3.

    The prefix (when it has two tokens) determines the future, so mask predictions can be
    learned; it trains on the ground truth since the continuation is deterministic."""
    model = tiny_model(TOY_V + 1, mask_token_id=TOY_MASK)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        x, targets = toy_batch(g)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def on(device, *models):
    """The module's models, copied to the device of a `gpu`-marked test (conftest.py)."""
    if device.type == "cpu":
        moved = list(models)
    else:
        moved = [copy.deepcopy(m).to(device) for m in models]
    if len(moved) == 1:
        return moved[0]
    return moved


def uncached(model, prompt, n, mode=GREEDY, stop_ids=()):
    return generate_uncached(model, prompt, n, mode, stop_ids=stop_ids)


def tokens(model, prompts, n, mode, **kw):
    gens, _ = generate(model, prompts, n, mode, **kw)
    return [g.tokens for g in gens]


def without_mask(model):
    fields = {**model.config.__dict__, "mask_token_id": None}
    clone = Transformer(ModelConfig(**fields)).eval()
    clone.load_state_dict(model.state_dict())
    return clone


# ----------------------------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("probs, tau, accepted", [
    # the leading run only
    ([0.95, 0.99, 0.5, 0.99], 0.9, 2),
    # never fewer than one
    ([0.2, 0.99, 0.99], 0.9, 1),
    # "at least tau"
    ([0.9, 0.9], 0.9, 2),
    ([0.5, 0.5, 0.5], 0.4, 3),
])
def test_confadapt_keeps_the_leading_confident_run(probs, tau, accepted):
    assert accept_confadapt(probs, tau) == accepted


def test_tau_one_is_greedy_on_a_saturated_softmax():
    # A saturated float32 softmax gives exactly 1.0; tau = 1.0 must still be plain greedy.
    logits = torch.tensor([[0.0, 40.0, 0.0], [0.0, 0.0, 60.0]])
    probs = logits.softmax(-1).max(-1).values.tolist()
    assert probs == [1.0, 1.0]
    assert accept_confadapt(probs, 1.0) == 1
    assert accept_confadapt(probs, 0.999) == 2


@pytest.mark.parametrize("drafts, greedy, accepted", [
    ([4, 5, 6], [4, 5, 6], 3),
    # everything after a miss is dropped
    ([4, 9, 6], [4, 5, 6], 1),
    ([9, 5], [4, 5], 0),
    ([], [], 0),
])
def test_verify_drafts_keeps_the_drafts_up_to_the_first_miss(drafts, greedy, accepted):
    assert verify_drafts(drafts, greedy) == accepted


@pytest.mark.parametrize("bad", [
    DecodeConfig(tau=0.0),
    DecodeConfig(tau=1.5),
    DecodeConfig("static", k=0),
    DecodeConfig(k_max=0),
    DecodeConfig("beam"),
])
def test_bad_settings(random_model, bad):
    with pytest.raises(ValueError):
        generate(random_model, [[1, 2]], 4, bad)


def test_greedy_makes_one_prediction_a_pass():
    assert GREEDY.block == 1


def test_greedy_is_no_rule_of_its_own():
    # greedy is static k = 1; "greedy" names no rule
    with pytest.raises(ValueError, match="unknown decoding rule 'greedy'"):
        DecodeConfig("greedy").validate()


def test_static_k_one_is_described_as_greedy():
    assert DecodeConfig("static", k=1).describe() == "greedy"
    assert DecodeConfig("static", k=2).describe() == "static k=2"


def test_static_decoding_needs_a_mask_token(random_model):
    plain = without_mask(random_model)
    with pytest.raises(ValueError, match="mask"):
        generate(plain, [[1, 2]], 4, DecodeConfig("static", k=2))


def test_greedy_decoding_needs_no_mask_token(random_model):
    plain = without_mask(random_model)
    assert tokens(plain, [[1, 2]], 4, GREEDY)


@pytest.mark.parametrize("prompts, kw, match", [
    ([[1] * 96], {}, "context"),
    ([[]], {}, "empty"),
    ([[1, 2]], {"batch_size": 0}, "batch_size"),
], ids=["too-long", "empty", "batch-size-0"])
def test_bad_inputs(random_model, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        generate(random_model, prompts, 4, GREEDY, **kw)


# ----------------------------------------------------------------------------------------------
# Every mode against its definition
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_greedy_matches_uncached_recompute(random_model, device):
    random_model = on(device, random_model)
    for p in PROMPTS:
        got = tokens(random_model, [p], 20, GREEDY)
        want, _ = uncached(random_model, p, 20)
        assert got == [want]


@pytest.mark.parametrize("mode", [
    DecodeConfig("confadapt", tau=1.0, k_max=8),
    DecodeConfig("confadapt", tau=0.1, k_max=1),
], ids=describe)
@pytest.mark.parametrize("fixture", ["random_model", "toy_model"])
def test_tau_one_and_k_max_one_are_greedy(request, fixture, mode):
    """Both decode greedy's tokens, one token a pass."""
    model = request.getfixturevalue(fixture)
    prompts = PROMPTS
    if fixture == "toy_model":
        prompts = TOY_PROMPTS
    greedy = tokens(model, prompts, 24, GREEDY)
    for p, want in zip(prompts, greedy):
        [gen], stats = generate(model, [p], 24, mode)
        assert gen.tokens == want
        assert stats.forward_passes == len(want)


def lesson_decoder(model, prompts, n, mode, stop_ids, batch_size):
    """confadapt.generate, batch_size prompts at a time.

    -> ((tokens, chunk sizes) per prompt, None: it counts no passes)"""
    size = batch_size or len(prompts)
    out = []
    for i in range(0, len(prompts), size):
        batch = prompts[i:i + size]
        out += confadapt.generate(model, batch, n, mode, stop_ids=stop_ids)
    return out, None


def engine_decoder(model, prompts, n, mode, stop_ids, batch_size):
    """mtp.engine.generate -> ((tokens, chunk sizes) per prompt, forward passes)."""
    kw = {"stop_ids": stop_ids, "batch_size": batch_size}
    gens, stats = generate(model, prompts, n, mode, **kw)
    got = [(g.tokens, g.chunk_sizes) for g in gens]
    return got, stats.forward_passes


@pytest.mark.parametrize("decoder", [lesson_decoder, engine_decoder], ids=["lesson", "engine"])
@pytest.mark.parametrize("mode", EVERY_MODE, ids=describe)
@pytest.mark.gpu
def test_generate_is_the_uncached_definition(random_model, toy_model, mode, decoder, device):
    """Both cached decoders give the tokens and chunk sizes of generate_uncached (the definition:
    one prompt, every pass recomputed), alone and batched: confadapt.generate (a KV cache, padded
    passes) and the engine (ragged passes, continuous batching)."""
    random_model, toy_model = on(device, random_model, toy_model)
    sizes = set()
    cases = [(random_model, PROMPTS), (toy_model, TOY_PROMPTS)]
    for model, prompts in cases:
        for stop_ids in [(), {prompts[1][-1], 7}]:
            want = [uncached(model, p, 30, mode, stop_ids) for p in prompts]
            for batch_size in (1, 2, None):
                got, passes = decoder(model, prompts, 30, mode, stop_ids, batch_size)
                assert got == want, batch_size
                # the engine, one row at a time: its passes add up
                if batch_size == 1 and passes is not None:
                    assert passes == sum(len(chunks) for _, chunks in want)
            for _, chunks in want:
                sizes |= set(chunks[:-1])
    if mode.kind == "static":
        assert sizes == {mode.block}
    else:
        # chunks of varied sizes: the rule is at work
        assert len(sizes) >= min(3, mode.block), sizes


@pytest.mark.gpu
def test_confadapt_accepts_chunks_on_a_trained_toy(toy_model, device):
    toy_model = on(device, toy_model)
    _, stats = generate(toy_model, TOY_PROMPTS, 30, TOY_CONFADAPT)
    assert stats.effective_k > 1.5


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.gpu
def test_lossless_is_greedy_on_random_models(random_model, seed, k, device):
    """Greedy's tokens, in one pass per chunk of the definition: fewer than greedy's 20 where
    drafts hold."""
    random_model = on(device, random_model)
    torch.manual_seed(seed)
    prompts = [torch.randint(0, 30, (n,)).tolist() for n in (1, 3, 6)]
    mode = DecodeConfig("lossless", k=k)
    for p in prompts:
        [gen], stats = generate(random_model, [p], 20, mode)
        greedy, _ = uncached(random_model, p, 20)
        _, chunks = uncached(random_model, p, 20, mode)
        assert gen.tokens == greedy
        assert stats.forward_passes == len(chunks)


def test_lookup_copies_what_followed_the_texts_last_tokens_earlier():
    # the last two tokens (5, 6) appeared at 0: what followed them
    assert lookup_drafts([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    # the latest place wins; the continuation may be shorter than asked
    assert lookup_drafts([1, 2, 9, 1, 2, 3, 1, 2], 4) == [3, 1, 2]
    # no earlier (2, 6): the last token alone
    assert lookup_drafts([6, 0, 2, 6], 2) == [0, 2]
    assert lookup_drafts([1, 2, 3], 2) == []
    assert lookup_drafts([4], 2) == []


@pytest.mark.parametrize("k", [2, 4])
def test_lossless_with_lookup_is_greedy_and_uses_its_drafts(random_model, k):
    """A random model's greedy text soon repeats itself: copied drafts hold there, so lookup
    takes fewer passes than lossless without it, and prints greedy's tokens."""
    prompts = [[1, 2, 3, 1, 2], [7], [4, 4, 9, 0, 4, 4]]
    greedy, _ = generate(random_model, prompts, 40, GREEDY)
    plain, plain_stats = generate(random_model, prompts, 40, DecodeConfig("lossless", k=k))
    gens, stats = generate(random_model, prompts, 40, DecodeConfig("lossless", k=k, lookup=True))
    assert [g.tokens for g in gens] == [g.tokens for g in greedy]
    assert stats.forward_passes < plain_stats.forward_passes


@pytest.fixture(scope="module")
def toy_greedy(toy_model):
    """Greedy on the toy, 40 tokens a prompt -> the generations."""
    gens, _ = generate(toy_model, TOY_PROMPTS, 40, GREEDY)
    return gens


@pytest.fixture(scope="module")
def toy_lossless(toy_model):
    """Lossless decoding on the toy, 40 tokens a prompt -> {k: (generations, statistics)}."""
    runs = {}
    for k in (4, 8):
        runs[k] = generate(toy_model, TOY_PROMPTS, 40, DecodeConfig("lossless", k=k))
    return runs


def test_greedy_on_a_trained_toy_is_the_uncached_definition(toy_model, toy_greedy):
    got = [g.tokens for g in toy_greedy]
    want = [uncached(toy_model, p, 40)[0] for p in TOY_PROMPTS]
    assert got == want


@pytest.mark.parametrize("k", [4, 8])
def test_lossless_is_greedy_on_a_trained_toy(toy_greedy, toy_lossless, k):
    gens, _ = toy_lossless[k]
    got = [g.tokens for g in gens]
    want = [g.tokens for g in toy_greedy]
    assert got == want


@pytest.mark.parametrize("k", [4, 8])
def test_lossless_takes_fewer_passes_than_greedy_on_a_trained_toy(toy_lossless, k):
    _, stats = toy_lossless[k]
    assert stats.row_passes < 0.7 * stats.tokens


@pytest.mark.parametrize("k", [4, 8])
def test_lossless_accepts_part_of_a_draft_on_a_trained_toy(toy_lossless, k):
    _, stats = toy_lossless[k]
    assert any(1 < size < k for size in stats.accept_hist)


# ----------------------------------------------------------------------------------------------
# The cache, stop tokens, batching, statistics
# ----------------------------------------------------------------------------------------------

def random_seq(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30, (40,), generator=g).tolist()


@torch.no_grad()
def test_cache_after_rollbacks_matches_full_recompute(random_model):
    """Two rows of different lengths: passes with masks, rolled back to different lengths per row,
    then the cached logits of the real continuation equal a full recompute."""
    seqs = [random_seq(1), random_seq(2)]
    cache = new_cache(random_model, 2, 96)
    prefill(random_model, cache, {0: seqs[1][:30], 1: seqs[1][:3]}, MASK)
    # row 0 starts afresh (a prompt joins)
    prefill(random_model, cache, {0: seqs[0][:8]}, MASK)
    # caches 7 and 2 tokens
    assert cache.lengths.tolist() == [7, 2]
    done = [7, 2]
    # the tokens fed per row
    for step in [(3, 5), (1, 6), (6, 2)]:
        inputs = [seqs[b][done[b]:done[b] + step[b]] + [MASK] * 4 for b in range(2)]
        decode_pass(random_model, cache, inputs, [0, 0], [1, 1], MASK)
        done = [done[b] + step[b] for b in range(2)]
        # drop the masks and the padding
        cache.rollback(torch.tensor(done))
    inputs = [seqs[b][done[b]:done[b] + 5] for b in range(2)]
    # (2, 5, V)
    got = decode_pass(random_model, cache, inputs, [0, 0], [5, 5], MASK)
    for b in range(2):
        seen = torch.tensor([seqs[b][:done[b] + 5]])
        full = random_model(seen)[0, done[b]:]
        assert torch.allclose(got[b], full, atol=1e-5)


@pytest.fixture(scope="module")
def stopped_mid_chunk(random_model):
    """Static k=4 decoding of PROMPTS[0], then again with a stop token strictly inside a chunk
    (not its first or last) that does not occur before it.

    -> (the full generation, the stopped one, its statistics, the stop's index, its chunk)"""
    mode = DecodeConfig("static", k=4)
    [gen], _ = generate(random_model, [PROMPTS[0]], 24, mode)
    ends = gen.boundaries
    cut, c = next(
        (i, c)
        for c in range(1, len(ends))
        for i in range(ends[c - 1] + 1, ends[c] - 1)
        if gen.tokens[i] not in gen.tokens[:i]
    )
    stop = gen.tokens[cut]
    [stopped], stats = generate(random_model, [PROMPTS[0]], 24, mode, stop_ids={stop})
    return gen, stopped, stats, cut, c


def test_a_stop_token_mid_chunk_ends_the_generation(stopped_mid_chunk):
    gen, stopped, _, cut, _ = stopped_mid_chunk
    assert stopped.tokens == gen.tokens[:cut + 1]
    assert stopped.stopped
    assert not gen.stopped


def test_a_stop_token_mid_chunk_cuts_its_chunk_short(stopped_mid_chunk):
    gen, stopped, _, cut, c = stopped_mid_chunk
    last = cut + 1 - gen.boundaries[c - 1]
    assert stopped.chunk_sizes == gen.chunk_sizes[:c] + [last]


def test_a_stop_token_mid_chunk_counts_the_tokens_up_to_it(stopped_mid_chunk):
    _, _, stats, cut, _ = stopped_mid_chunk
    assert stats.tokens == cut + 1


def test_a_stop_token_mid_chunk_is_the_uncached_definition(random_model, stopped_mid_chunk):
    gen, stopped, _, cut, _ = stopped_mid_chunk
    mode = DecodeConfig("static", k=4)
    stop = {gen.tokens[cut]}
    want = uncached(random_model, PROMPTS[0], 24, mode, stop)
    assert (stopped.tokens, stopped.chunk_sizes) == want


def early_stop(prompts):
    """A stop token that ends some rows early: the batch shrinks."""
    return {prompts[0][0]}


def one_at_a_time(model, prompts, mode):
    """Each prompt alone -> the generations."""
    stop_ids = early_stop(prompts)
    alone = []
    for p in prompts:
        [gen], _ = generate(model, [p], 25, mode, stop_ids=stop_ids)
        alone.append(gen)
    return alone


def batch_runs(model, prompts, mode):
    """All prompts at once, and two rows at a time.

    -> ((generations, statistics), (generations, statistics))"""
    stop_ids = early_stop(prompts)
    batched = generate(model, prompts, 25, mode, stop_ids=stop_ids)
    # Two rows at a time: a finished row's place goes to the next waiting prompt.
    joined = generate(model, prompts, 25, mode, stop_ids=stop_ids, batch_size=2)
    return batched, joined


def outcome(gen):
    return gen.tokens, gen.chunk_sizes, gen.stopped


@pytest.mark.parametrize("mode", MODES, ids=describe)
@pytest.mark.gpu
def test_batched_equals_one_at_a_time(random_model, toy_model, mode, device):
    random_model, toy_model = on(device, random_model, toy_model)
    cases = [(random_model, PROMPTS), (toy_model, TOY_PROMPTS)]
    for model, prompts in cases:
        alone = one_at_a_time(model, prompts, mode)
        (batched, _), (joined, _) = batch_runs(model, prompts, mode)
        for a, b, j in zip(alone, batched, joined):
            assert outcome(b) == outcome(a)
            assert outcome(j) == outcome(a)


@pytest.fixture(scope="module", params=MODES, ids=describe)
def batch_stats(request, random_model, toy_model):
    """Per model: the statistics of all prompts at once and of two rows at a time."""
    mode = request.param
    stats = []
    cases = [(random_model, PROMPTS), (toy_model, TOY_PROMPTS)]
    for model, prompts in cases:
        batched, joined = batch_runs(model, prompts, mode)
        stats.append((batched, joined, len(prompts)))
    return stats


def test_a_batch_holds_every_prompt(batch_stats):
    for (_, stats), _, n_prompts in batch_stats:
        assert stats.batch_size == n_prompts


def test_a_batch_takes_as_many_passes_as_its_longest_row(batch_stats):
    for (batched, stats), _, _ in batch_stats:
        assert stats.forward_passes == max(g.forward_passes for g in batched)


def test_two_rows_at_a_time_hold_two_rows(batch_stats):
    for _, (_, joined_stats), _ in batch_stats:
        assert joined_stats.batch_size == 2


def test_two_rows_at_a_time_take_between_the_batch_and_the_rows_passes(batch_stats):
    for (batched, stats), (_, joined_stats), _ in batch_stats:
        longest = max(g.forward_passes for g in batched)
        assert longest <= joined_stats.forward_passes < stats.row_passes


@pytest.fixture(scope="module")
def toy_confadapt(toy_model):
    """ConfAdapt on the toy, 30 tokens a prompt -> (generations, statistics)."""
    return generate(toy_model, TOY_PROMPTS, 30, TOY_CONFADAPT)


def test_statistics_count_the_tokens(toy_confadapt):
    gens, stats = toy_confadapt
    assert stats.tokens == sum(len(g.tokens) for g in gens)


def test_statistics_count_the_passes(toy_confadapt):
    gens, stats = toy_confadapt
    passes = sum(g.forward_passes for g in gens)
    assert stats.row_passes == passes == sum(stats.accept_hist.values())


def test_the_acceptance_histogram_adds_up_to_the_tokens(toy_confadapt):
    _, stats = toy_confadapt
    accepted = sum(n * c for n, c in stats.accept_hist.items())
    assert accepted == stats.tokens


def test_effective_k_is_tokens_per_pass(toy_confadapt):
    _, stats = toy_confadapt
    assert stats.effective_k == pytest.approx(stats.tokens / stats.row_passes)


def test_statistics_time_the_decoding(toy_confadapt):
    _, stats = toy_confadapt
    assert stats.seconds > stats.prefill_seconds > 0
    assert stats.tokens_per_second > 0


def test_statistics_count_the_positions_fed(toy_confadapt):
    # Each pass feeds the last pass's tokens (the first: the prompt's last) plus k_max - 1
    # masks, fewer when fewer tokens are still wanted; the batch's padding is not counted.
    gens, stats = toy_confadapt
    fed = 0
    for g in gens:
        for i, n in enumerate(g.chunk_sizes):
            tokens_fed = g.chunk_sizes[i - 1] if i else 1
            wanted = 30 - sum(g.chunk_sizes[:i])
            fed += tokens_fed + min(8, wanted) - 1
    assert stats.fed_tokens == fed


def test_greedy_feeds_one_position_a_token(toy_model):
    _, greedy = generate(toy_model, TOY_PROMPTS, 30, GREEDY)
    assert greedy.fed_tokens == greedy.tokens


def test_every_row_gets_its_tokens_in_chunks_of_at_most_k_max(toy_confadapt):
    gens, _ = toy_confadapt
    for g in gens:
        assert len(g.tokens) == 30
        assert g.boundaries[-1] == 30
        assert sum(g.chunk_sizes) == 30
        assert max(g.chunk_sizes) <= 8


@pytest.mark.parametrize("mode", MODES, ids=describe)
def test_generation_stops_at_the_end_of_the_context(random_model, mode):
    # max_seq_len is 96
    prompt = [1] * 90
    [gen], _ = generate(random_model, [prompt], 50, mode)
    assert len(gen.tokens) == 6


@pytest.mark.parametrize("mode", MODES, ids=describe)
def test_the_lesson_stops_where_the_engine_does(random_model, mode):
    prompt = [1] * 90
    [gen], _ = generate(random_model, [prompt], 50, mode)
    [(got, _)] = confadapt.generate(random_model, [prompt], 50, mode)
    assert got == gen.tokens


# ----------------------------------------------------------------------------------------------
# The command line, and the benchmark (benchmarks/bench_modes.py, run as a script)
# ----------------------------------------------------------------------------------------------

def cli(*args):
    """confadapt.main on a prompt, with these arguments -> its exit status."""
    return confadapt.main(["--prompt", *args])


@pytest.mark.parametrize("argv, message", [
    (["--tau", "1.5"], "tau"),
    (["--tau", "0"], "tau"),
    (["--static-k", "0"], "--static-k: must be at least 1"),
    (["--k-max", "0"], "--k-max: must be at least 1"),
    (["--static-k", "2", "--lossless"], "not allowed with"),
    (["--static-k", "2", "--tau", "0.5"], "ConfAdapt only"),
    (["--lookup"], "--lossless only"),
])
def test_cli_bad_arguments(capsys, argv, message):
    status = cli("x", "--model", "/nonexistent", *argv)
    assert status == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_cli_missing_model(capsys):
    status = cli("x", "--model", "/nonexistent")
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model /nonexistent: no such folder")
    assert err.count("\n") == 1


def saved_model(path, with_mask):
    """A tiny random model with the toy tokenizer, saved in `path`."""
    tok = toy_tokenizer()
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    model = tiny_model(tok.n_vocab, **ONE_LAYER, max_seq_len=48, **ids)
    if with_mask:
        add_mask_token(model, tok)
    save_pretrained(model, path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny random model with the toy tokenizer, saved with and without a <mask> token."""
    plain = saved_model(tmp_path_factory.mktemp("plain"), with_mask=False)
    mtp = saved_model(tmp_path_factory.mktemp("mtp"), with_mask=True)
    return {"plain": plain, "mtp": mtp}


@pytest.mark.parametrize("flags, mode", [
    ([], DecodeConfig("confadapt", tau=0.9, k_max=16)),
    (["--static-k", "3"], DecodeConfig("static", k=3)),
    (["--lossless", "--k-max", "4"], DecodeConfig("lossless", k=4)),
    (["--lossless", "--k-max", "4", "--lookup"], DecodeConfig("lossless", k=4, lookup=True)),
    (["--greedy"], GREEDY),
], ids=["confadapt", "static", "lossless", "lookup", "greedy"])
def test_cli_json_matches_generate(model_dirs, capsys, flags, mode):
    path = model_dirs["mtp"]
    args = ["--max-new-tokens", "9", "--json", *flags]
    status = cli("1 2 3", "--model", path, *args)
    assert status == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "tokens", "forward_passes", "effective_k", "seconds"} <= set(out)
    model = from_pretrained(path)
    tok = Tokenizer.from_pretrained(path)
    prompt = [tok.bos_id] + tok.encode("1 2 3")
    [gen], _ = generate(model, [prompt], 9, mode, stop_ids=tok.stop_ids)
    assert out["tokens"] == gen.tokens
    assert out["text"] == tok.decode(gen.tokens)
    assert out["forward_passes"] == gen.forward_passes
    assert out["mode"] == mode.describe()


@pytest.fixture(scope="module")
def cli_text_run(model_dirs, tmp_path_factory):
    """Static k=2 on "1 2", shown as text and drawn as a PNG -> (printed text, the PNG's path)."""
    png = tmp_path_factory.mktemp("png") / "chunks.png"
    args = ["--max-new-tokens", "5", "--static-k", "2", "--color", "never", "--png", str(png)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli("1 2", "--model", model_dirs["mtp"], *args)
    assert status == 0
    return printed.getvalue(), png


def test_cli_prints_the_chunks_and_their_statistics(cli_text_run):
    out, _ = cli_text_run
    assert out.startswith("1 2[")
    assert "effective k" in out
    assert "forward passes  3" in out


def test_cli_draws_the_chunks_as_a_png(cli_text_run):
    _, png = cli_text_run
    assert png.stat().st_size > 1000


def test_cli_needs_a_mask_token_for_mtp_decoding(model_dirs, capsys):
    status = cli("1 2", "--model", model_dirs["plain"])
    assert status == 2
    assert "no mask token" in capsys.readouterr().err


def test_cli_greedy_needs_no_mask_token(model_dirs, capsys):
    args = ["--greedy", "--json", "--max-new-tokens", "3"]
    status = cli("1 2", "--model", model_dirs["plain"], *args)
    assert status == 0
    out = json.loads(capsys.readouterr().out)
    n = len(out["tokens"])
    assert out["mode"] == "greedy"
    # one token a pass
    assert out["forward_passes"] == n > 0
    assert out["chunk_sizes"] == [1] * n


def test_cli_prompt_longer_than_the_context(model_dirs, capsys):
    prompt = " ".join(["7"] * 60)
    status = cli(prompt, "--model", model_dirs["mtp"])
    assert status == 2
    err = capsys.readouterr().err
    assert "does not fit the context" in err
    assert err.count("\n") == 1


def bench_modes(*args) -> str:
    """benchmarks/bench_modes.py run as a script -> its output."""
    script = os.path.join(ROOT, "benchmarks", "bench_modes.py")
    command = [sys.executable, script, *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture(scope="module")
def bench_report(model_dirs):
    """The benchmark's JSON: two prompts, batch sizes 1 and 2, two taus."""
    out = bench_modes(
        "--model", model_dirs["mtp"],
        "--prompt", "1 2 3",
        "--prompt", "4",
        "--max-new-tokens", "6",
        "--batch-sizes", "1", "2",
        "--taus", "0.5", "0.9",
        "--repeats", "1",
        "--latency-max", "3",
        "--json",
        "--threads", "1",
    )
    return json.loads(out)


def test_bench_json_has_every_mode_at_every_batch_size(bench_report):
    rows = bench_report["results"]
    modes = {r["mode"] for r in rows}
    assert modes == {
        "greedy",
        "static k=4",
        "confadapt tau=0.5 k_max=16",
        "confadapt tau=0.9 k_max=16",
        "lossless k=16",
    }
    assert len(rows) == 10
    assert {r["batch_size"] for r in rows} == {1, 2}


def test_bench_json_has_a_latency_curve_per_batch_size(bench_report):
    latency = bench_report["latency_seconds"]
    assert set(latency) == {"1", "2"}
    assert set(latency["2"]) == {"1", "2", "3"}


def test_bench_json_measures_speed_ups_against_greedy(bench_report):
    rows = bench_report["results"]
    assert all(r["speedup"] == 1.0 for r in rows if r["kind"] == "greedy")


def test_bench_json_lossless_prints_greedys_tokens(bench_report):
    """Every batch size decodes the same rows, and lossless prints greedy's tokens."""
    rows = bench_report["results"]
    got = {(r["batch_size"], r["kind"]): r["tokens"] for r in rows}
    assert got[1, "greedy"] == got[2, "greedy"] == got[1, "lossless"] == got[2, "lossless"]
    assert all(r["equals_greedy"] for r in rows if r["kind"] in ("greedy", "lossless"))


@pytest.fixture(scope="module")
def bench_table(model_dirs):
    """The benchmark's table: one prompt, batch size 1, one tau."""
    return bench_modes(
        "--model", model_dirs["mtp"],
        "--prompt", "1 2 3",
        "--max-new-tokens", "4",
        "--batch-sizes", "1",
        "--taus", "0.9",
        "--repeats", "1",
        "--latency-max", "2",
        "--threads", "1",
    )


def test_bench_table_shows_speed_ups_and_latency(bench_table):
    assert "speed-up" in bench_table
    assert "forward-pass latency" in bench_table


def test_bench_table_has_a_line_per_mode(bench_table):
    # a header, one line per mode (greedy, static, ConfAdapt, lossless), the latency curve
    assert len(bench_table.splitlines()) == 1 + 4 + 3
