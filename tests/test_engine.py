"""mtp/engine.py: the decoding engine's ragged passes against a full
recompute, and the promises that make them fast (the padding is never
computed or cached; the host reads the device once a pass).

Its decoding (prefill, passes, continuous batching) is tested with the
rules it serves, in tests/test_confadapt.py.
"""
import pytest
import torch

from model import ModelConfig, Transformer
from mtp.engine import HostSyncs, RaggedPass, cached_forward, new_cache, ragged_cells


def small_random_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2,
                                   n_heads=4, n_kv_heads=2,
                                   ffn_dim=96)).eval()


@pytest.mark.gpu
def test_a_pass_of_every_row_is_the_models_own_cached_pass(device):
    """Without n_tokens every row feeds all T tokens: the engine's pass (a
    benchmark's latency curve) computes what model.KVCache's does."""
    model = small_random_model().to(device)
    seq = torch.randint(0, 97, (2, 30)).to(device)
    plain = model.new_cache(2, 64)
    ours = new_cache(model, 2, 64)
    with torch.no_grad():
        for start, end in [(0, 9), (9, 10), (10, 30)]:
            want = model(seq[:, start:end], cache=plain)
            got = cached_forward(model, seq[:, start:end], ours)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert ours.lengths.tolist() == plain.lengths.tolist() == [30, 30]


@pytest.mark.gpu
def test_ragged_pass_matches_full_recompute_and_caches_only_real_tokens(device):
    """n_tokens: each row feeds its own number of tokens; the padding is
    neither computed nor cached."""
    model = small_random_model().to(device)
    seq = torch.randint(0, 97, (3, 40)).to(device)
    with torch.no_grad():
        full = model(seq)
        cache = new_cache(model, 3, 64)
        done = [0, 0, 0]
        for feed in ([5, 1, 9], [3, 7, 0], [1, 12, 4], [9, 2, 2]):
            T = max(feed)
            # 96: padding
            tokens = torch.full((3, T), 96, device=device)
            for b, n in enumerate(feed):
                tokens[b, :n] = seq[b, done[b]:done[b] + n]
            # the padding's outputs repeat the last real one
            want = [list(range(n)) + [max(n - 1, 0)] * (T - n)
                    for n in feed]
            got = cached_forward(model, tokens, cache, n_tokens=feed,
                                 output_index=torch.tensor(want, device=device))
            for b, n in enumerate(feed):
                assert torch.allclose(got[b, :n], full[b, done[b]:done[b] + n],
                                      atol=1e-5)
                done[b] += n
            # advanced by the real tokens only
            assert cache.lengths.tolist() == done

        # Without output_index: (B, T, V), real positions right (the padding's
        # logits are meaningless). A tensor n_tokens works too.
        tokens = torch.stack([seq[b, n:n + 2]
                              for b, n in enumerate(done)])
        got = cached_forward(model, tokens, cache,
                             n_tokens=torch.tensor([2, 1, 2], device=device))
        for b, n in enumerate([2, 1, 2]):
            assert torch.allclose(got[b, :n], full[b, done[b]:done[b] + n],
                                  atol=1e-5)


def test_cached_passes_reading_whole_key_blocks_match_full_recompute():
    """On a GPU a cached pass reads the key slots in blocks of 64
    (DecodeCache.key_block), so the attention shapes change once per block:
    the unwritten slots it reads must change nothing."""
    model = small_random_model()
    seq = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        full = model(seq)
        cache = new_cache(model, 3, 100)
        cache.key_block = 64
        assert RaggedPass(cache, 5).S == 64
        assert RaggedPass(cache, 99).S == 100
        done = [0, 0, 0]
        for feed in ([5, 1, 9], [3, 7, 0], [1, 12, 4], [9, 2, 2]):
            T = max(feed)
            tokens = torch.zeros(3, T, dtype=torch.long)
            for b, n in enumerate(feed):
                tokens[b, :n] = seq[b, done[b]:done[b] + n]
            got = cached_forward(model, tokens, cache, n_tokens=feed)
            for b, n in enumerate(feed):
                want = full[b, done[b]:done[b] + n]
                torch.testing.assert_close(got[b, :n], want,
                                           atol=1e-5, rtol=1e-5)
                done[b] += n
        assert cache.lengths.tolist() == done


def test_a_ragged_pass_reads_the_device_once_whatever_the_depth():
    """Ragged decoding builds its index tensors once per pass from
    host-side lengths: the host waits for the device a fixed number of
    times per pass, not several times per layer."""
    counts = []
    for n_layers in (1, 6):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=50, dim=32,
                                        n_layers=n_layers, n_heads=4,
                                        n_kv_heads=2, ffn_dim=64)).eval()
        cache = new_cache(model, 3, 64)
        with torch.no_grad():
            cached_forward(model, torch.randint(0, 50, (3, 10)), cache,
                           n_tokens=[10, 4, 7])
            with HostSyncs() as syncs:
                cached_forward(model, torch.randint(0, 50, (3, 6)), cache,
                               n_tokens=[6, 0, 2])
        counts.append(syncs.total)
    # cache.lengths, read once
    assert counts[0] == counts[1] == 1, counts


def test_ragged_cells_is_its_worked_example():
    cells = ragged_cells([3, 5, 4], fed=[2, 0, 1], T=2)
    assert cells == ([0, 2], [0, 0, 2], [3, 4, 4], [0, 1, 2], [0, 1, 4])


def test_engine_cache_overflow_is_an_error():
    model = small_random_model()
    cache = new_cache(model, 2, 8)
    with pytest.raises(ValueError, match="KV cache overflow: 9 slots needed"):
        cached_forward(model, torch.zeros(2, 9, dtype=torch.long), cache,
                       n_tokens=[9, 3])
    assert cache.lengths.tolist() == [0, 0]


def test_rows_leave_the_cache_in_the_order_given():
    """Continuous batching: finished rows leave, the others keep their keys,
    values and lengths."""
    model = small_random_model()
    cache = new_cache(model, 3, 16)
    with torch.no_grad():
        cached_forward(model, torch.randint(0, 97, (3, 5)), cache, n_tokens=[5, 2, 4])
    k = cache.k.clone()
    cache.keep_rows([2, 0])
    assert cache.lengths.tolist() == [4, 5]
    assert torch.equal(cache.k, k[:, [2, 0]])
