"""mtp/engine.py: the decoding engine's ragged passes against a full
recompute, and the promises that make them fast (the padding is never
computed or cached; the host reads the device once a pass).

Its decoding (prefill, passes, continuous batching) is tested with the
rules it serves, in tests/test_confadapt.py.
"""
import pytest
import torch

from adapter import add_mask_adapter
from confadapt import DecodeConfig
from conftest import tiny_model
from mtp import engine
from mtp.engine import (HostSyncs, RaggedPass, attention_groups, cached_forward, generate,
                        new_cache, ragged_cells)

VOCAB = 97

# The tokens each of three rows feeds, pass after pass: rows of different lengths, a row that
# feeds none, and one row feeding far more than the others (it attends in a group of its own).
FEEDS = [[5, 1, 9], [3, 7, 0], [1, 12, 4], [9, 2, 2], [1, 14, 1]]

# The token that pads the shorter rows of a pass.
PAD = 96


def small_random_model():
    return tiny_model(VOCAB, dim=48, ffn_dim=96, max_seq_len=2048).eval()


def random_tokens(B, T, device="cpu"):
    seq = torch.randint(0, VOCAB, (B, T))
    return seq.to(device)


def ragged_tokens(seq, done, feed, pad=0):
    """Row b's next feed[b] tokens of `seq`, after its first done[b], padded -> (B, max(feed))."""
    tokens = torch.full((len(feed), max(feed)), pad, device=seq.device)
    for b, n in enumerate(feed):
        tokens[b, :n] = seq[b, done[b]:done[b] + n]
    return tokens


def padding_repeats_the_last_real_output(feed, device):
    """The output_index that reads the padding's outputs from the row's last real token."""
    T = max(feed)
    index = [list(range(n)) + [max(n - 1, 0)] * (T - n) for n in feed]
    return torch.tensor(index, device=device)


@pytest.mark.gpu
def test_a_pass_of_every_row_is_the_models_own_cached_pass(device):
    """Without n_tokens every row feeds all T tokens: the engine's pass (a
    benchmark's latency curve) computes what model.KVCache's does."""
    model = small_random_model().to(device)
    seq = random_tokens(2, 30, device)
    plain = model.new_cache(2, 64)
    ours = new_cache(model, 2, 64)
    with torch.no_grad():
        for start, end in [(0, 9), (9, 10), (10, 30)]:
            tokens = seq[:, start:end]
            want = model(tokens, cache=plain)
            got = cached_forward(model, tokens, ours)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ours.lengths.tolist() == plain.lengths.tolist() == [30, 30]


@torch.no_grad()
def ragged_passes(device):
    """Three rows fed FEEDS' tokens of 40 random ones, padded with PAD, each pass reading the
    padding's outputs from the last real token.

    -> (the model, the tokens, a full forward of them, the cache, and per pass:
        (tokens fed per row, tokens done per row before it, its logits, the cache's lengths))"""
    model = small_random_model().to(device)
    seq = random_tokens(3, 40, device)
    full = model(seq)
    cache = new_cache(model, 3, 64)
    done = [0, 0, 0]
    passes = []
    for feed in FEEDS:
        tokens = ragged_tokens(seq, done, feed, pad=PAD)
        index = padding_repeats_the_last_real_output(feed, device)
        got = cached_forward(model, tokens, cache, n_tokens=feed, output_index=index)
        lengths = cache.lengths.tolist()
        passes.append((feed, list(done), got, lengths))
        done = [d + n for d, n in zip(done, feed)]
    return model, seq, full, cache, passes


@pytest.mark.gpu
def test_ragged_pass_matches_full_recompute(device):
    """n_tokens: each row feeds its own number of tokens; the padding is never computed."""
    _, _, full, _, passes = ragged_passes(device)
    for feed, done, got, _ in passes:
        for b, n in enumerate(feed):
            want = full[b, done[b]:done[b] + n]
            assert torch.allclose(got[b, :n], want, atol=1e-5)


@pytest.mark.gpu
def test_ragged_pass_caches_only_real_tokens(device):
    """The cache advances by the real tokens only: the padding is never cached."""
    _, _, _, _, passes = ragged_passes(device)
    for feed, done, _, lengths in passes:
        advanced = [d + n for d, n in zip(done, feed)]
        assert lengths == advanced


@pytest.mark.gpu
def test_ragged_pass_without_output_index_and_with_a_tensor_n_tokens(device):
    """Without output_index a pass returns (B, T, V), real positions right (the padding's
    logits are meaningless); a tensor n_tokens works too."""
    model, seq, full, cache, _ = ragged_passes(device)
    done = cache.lengths.tolist()
    tokens = torch.stack([seq[b, n:n + 2] for b, n in enumerate(done)])
    feed = [2, 1, 2]
    n_tokens = torch.tensor(feed, device=device)
    with torch.no_grad():
        got = cached_forward(model, tokens, cache, n_tokens=n_tokens)
    for b, n in enumerate(feed):
        want = full[b, done[b]:done[b] + n]
        assert torch.allclose(got[b, :n], want, atol=1e-5)


def test_a_pass_reads_the_key_slots_in_whole_blocks():
    model = small_random_model()
    cache = new_cache(model, 3, 100)
    cache.key_block = 64
    assert RaggedPass(cache, 5).S == 64
    assert RaggedPass(cache, 99).S == 100


@torch.no_grad()
def test_cached_passes_reading_whole_key_blocks_match_full_recompute():
    """On a GPU a cached pass reads the key slots in blocks of 64
    (DecodeCache.key_block), so the attention shapes change once per block:
    the unwritten slots it reads must change nothing."""
    model = small_random_model()
    seq = random_tokens(3, 40)
    full = model(seq)
    cache = new_cache(model, 3, 100)
    cache.key_block = 64
    done = [0, 0, 0]
    for feed in FEEDS:
        tokens = ragged_tokens(seq, done, feed)
        got = cached_forward(model, tokens, cache, n_tokens=feed)
        for b, n in enumerate(feed):
            want = full[b, done[b]:done[b] + n]
            torch.testing.assert_close(got[b, :n], want, atol=1e-5, rtol=1e-5)
            done[b] += n
    assert cache.lengths.tolist() == done


@torch.no_grad()
def host_syncs_of_a_pass(n_layers):
    """How often a ragged pass of a model `n_layers` deep makes the host wait for the device."""
    model = tiny_model(50, n_layers=n_layers).eval()
    cache = new_cache(model, 3, 64)
    prompt = torch.randint(0, 50, (3, 10))
    cached_forward(model, prompt, cache, n_tokens=[10, 4, 7])
    tokens = torch.randint(0, 50, (3, 6))
    with HostSyncs() as syncs:
        cached_forward(model, tokens, cache, n_tokens=[6, 0, 2])
    return syncs.total


def test_a_ragged_pass_waits_for_the_device_once_whatever_the_depth():
    """Ragged decoding builds its index tensors once per pass from the
    lengths the cache keeps on the host: the host waits for the device a
    fixed number of times per pass, not several times per layer."""
    shallow = host_syncs_of_a_pass(1)
    deep = host_syncs_of_a_pass(6)
    # the indices' one copy to the device
    assert shallow == deep == 1, (shallow, deep)


MODES = [DecodeConfig("static", k=1), DecodeConfig("static", k=3),
         DecodeConfig("confadapt", tau=0.5, k_max=4), DecodeConfig("lossless", k=4)]


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.describe())
def test_a_decoding_pass_waits_for_the_device_at_most_4_times(mode, adapter):
    """Each decoding pass of `generate` (continuous batching: five prompts on three cache rows),
    counted with HostSyncs: the one copy of the pass's indices and tokens, the predictions,
    ConfAdapt's confidences, the rollback's lengths; and with the gated adapter, the rows that
    hold <mask>."""
    model = tiny_model(50, mask_token_id=49).eval()
    if adapter:
        add_mask_adapter(model, rank=4, alpha=8.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11] * 7, [12, 13]]
    per_pass, stats = engine.syncs_per_pass(model, prompts, 12, mode, batch_size=3)
    assert len(per_pass) == stats.forward_passes > 4
    assert max(per_pass) <= 4 + adapter, per_pass


@torch.no_grad()
def test_a_pass_makes_its_attention_mask_once_in_the_queries_dtype(monkeypatch):
    """Every layer of a pass attends under the same mask: it is made once, at the first layer,
    in the dtype the layers compute in (a bool mask is converted by the kernel in every call)."""
    made = []
    make = engine.kernel_mask

    def spy(mask, g, dtype):
        made.append(dtype)
        return make(mask, g, dtype)

    monkeypatch.setattr(engine, "kernel_mask", spy)
    model = tiny_model(50, n_layers=4).to(torch.bfloat16).eval()
    cache = new_cache(model, 2, 32)
    cached_forward(model, torch.randint(0, 50, (2, 6)), cache, n_tokens=[6, 3])
    assert made == [torch.bfloat16]


def test_ragged_cells_is_its_worked_example():
    cells = ragged_cells([3, 5, 4], fed=[2, 0, 1], T=2)
    assert cells == ([0, 2], [0, 0, 2], [3, 4, 4], [0, 1, 2], [0, 1, 4])


def test_a_row_feeding_far_more_than_the_others_attends_apart():
    assert attention_groups([1, 1, 0, 57, 1]) == [[0, 1, 4], [3]]
    assert attention_groups(FEEDS[-1]) == [[0, 2], [1]]
    # apart only where that at least halves the grid (27 cells -> 13, but 27 -> 19 is not)
    assert [len(attention_groups(f)) for f in FEEDS] == [1, 1, 1, 2, 2]
    assert attention_groups([4, 4, 4]) == [[0, 1, 2]] and attention_groups([0, 3]) == [[1]]
    # a short feed attends with the others, though apart it would halve the grid: a second
    # attention call costs more (benchmarks/pass_shapes.py, SmolLM2, 16 rows: 98 ms a pass in
    # one group, 111 in two)
    assert attention_groups([1] * 14 + [3] * 2) == [list(range(16))]
    assert len(attention_groups([1] * 14 + [8] * 2)) == 2


def test_engine_cache_overflow_is_an_error():
    model = small_random_model()
    cache = new_cache(model, 2, 8)
    tokens = torch.zeros(2, 9, dtype=torch.long)
    message = "KV cache overflow: 9 slots needed"
    with pytest.raises(ValueError, match=message):
        cached_forward(model, tokens, cache, n_tokens=[9, 3])
    assert cache.lengths.tolist() == [0, 0]


@pytest.fixture
def three_rows_cached():
    """A cache of three rows holding 5, 2 and 4 tokens."""
    model = small_random_model()
    cache = new_cache(model, 3, 16)
    tokens = random_tokens(3, 5)
    with torch.no_grad():
        cached_forward(model, tokens, cache, n_tokens=[5, 2, 4])
    return cache


def test_rows_leave_the_cache_in_the_order_given(three_rows_cached):
    """Continuous batching: finished rows leave, the others keep their lengths."""
    cache = three_rows_cached
    cache.keep_rows([2, 0])
    assert cache.lengths.tolist() == [4, 5]


def test_rows_that_stay_keep_their_keys(three_rows_cached):
    """Continuous batching: the rows that stay keep their keys, in the order given."""
    cache = three_rows_cached
    k = cache.k.clone()
    cache.keep_rows([2, 0])
    assert torch.equal(cache.k, k[:, [2, 0]])


def test_a_row_that_joins_takes_the_place_of_one_that_left(three_rows_cached):
    """The cache keeps its storage: a row leaving copies only the rows that change place, and a
    row joining takes a place already there, empty (length 0), without a new allocation."""
    cache = three_rows_cached
    k = cache.k.clone()
    storage = cache.storage["k"].data_ptr()
    cache.keep_rows([0, 2])
    assert torch.equal(cache.k, k[:, [0, 2]])
    cache.grow(3, cache.max_len)
    assert cache.storage["k"].data_ptr() == storage
    assert cache.lengths.tolist() == [5, 4, 0] and cache.host_lengths == [5, 4, 0]
    assert torch.equal(cache.k[:, :2], k[:, [0, 2]])
    # more rows or slots than it held: new storage, the rows keep their keys
    cache.grow(4, cache.max_len + 8)
    assert cache.storage["k"].data_ptr() != storage and cache.k.shape[1] == 4
    assert torch.equal(cache.k[:, :2, :, :16], k[:, [0, 2]])
