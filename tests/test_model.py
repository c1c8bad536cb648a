"""model.py: attention against its definition, the KV cache against a full
recompute, and the whole model against the transformers reference.

The reference tests need transformers (they are skipped without it) and
download nothing: each builds a random Llama-3-style, Qwen3-style or
Qwen2-style model with transformers, saves it in the Hugging Face layout
(single file or sharded), loads it with mtp.hf.from_pretrained and compares
logits and greedy continuations.
"""
import os

import pytest
import torch

from model import ModelConfig, Transformer, attend, rope_inv_freq
from mtp.engine import cached_forward, new_cache
from mtp.hf import from_pretrained

# The shape every tiny checkpoint shares; each architecture adds its own fields.
TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LLAMA3 = dict(
    TINY,
    model_type="llama",
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
QWEN3 = dict(
    TINY,
    model_type="qwen3",
    head_dim=24,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
QWEN2 = dict(
    TINY,
    model_type="qwen2",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)


def hf_model(fields: dict, seed=0):
    """A random transformers model of this config (the test is skipped without
    transformers)."""
    transformers = pytest.importorskip("transformers")
    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"),
                                               **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # random non-trivial norms and biases, so they are tested too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def greedy_ours(model, prompt, n):
    """Plain k=1 greedy decoding with our KV cache (one token per
    forward pass)."""
    cache = model.new_cache(1, prompt.shape[1] + n)
    out, x = [], prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(x, cache=cache)[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            x = nxt
    return torch.cat(out, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [LLAMA3, QWEN3, QWEN2],
                         ids=["llama3", "qwen3", "qwen2"])
@pytest.mark.parametrize("shard", [False, True],
                         ids=["single", "sharded"])
def test_logits_and_greedy_match_transformers(tmp_path, fields, shard, device):
    ref = hf_model(fields)
    ref.save_pretrained(tmp_path,
                        max_shard_size="40KB" if shard else "5GB")
    files = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in files) == shard
    ours = from_pretrained(tmp_path, device=device)
    ref.to(device)

    # 200 positions: well past original_max_position_embeddings (64), where
    # llama3 scaling acts.
    tokens = torch.randint(0, fields["vocab_size"], (2, 200),
                           generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    with torch.no_grad():
        diff = (ours(tokens) - ref(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff

    prompt = tokens[:1, :16]
    hf_out = ref.generate(prompt, max_new_tokens=32,
                          do_sample=False,
                          min_new_tokens=32, pad_token_id=0,
                          eos_token_id=None)[:, 16:]
    assert torch.equal(greedy_ours(ours, prompt, 32), hf_out)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [LLAMA3, QWEN3],
                         ids=["llama3", "qwen3"])
def test_bfloat16_is_as_close_to_float32_as_transformers(tmp_path, fields, device):
    """In bfloat16 neither implementation equals float32; ours must
    stray no further than theirs."""
    ref = hf_model(fields)
    ref.save_pretrained(tmp_path)
    tokens = torch.randint(0, fields["vocab_size"], (2, 120),
                           generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    with torch.no_grad():
        exact = ref.to(device)(tokens).logits
        theirs = ref.to(torch.bfloat16)(tokens).logits.float()
        ours = from_pretrained(tmp_path, device=device,
                               dtype=torch.bfloat16)(tokens).float()
    their_err = (theirs - exact).abs().mean()
    our_err = (ours - exact).abs().mean()
    assert 0 < our_err <= 1.5 * their_err, (our_err, their_err)


def reference_attention(q, k, v, mask):
    """The definition in float64: every query head against its group's
    K/V head, masked softmax."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    # (B, H, T, S)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool,
                          device=q.device).tril()
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (weights @ v).to(q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)],
                         ids=["mha", "gqa", "mqa"])
def test_attend_matches_the_definition(heads, device):
    """model.attend (causal via is_causal; masks with GQA folded into
    the queries) against the definition, and against the call it
    replaces (a boolean mask with enable_gqa)."""
    H, n_kv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, H, 20, 16, generator=g).to(device)
    k, v = (torch.randn(3, n_kv, 20, 16, generator=g).to(device)
            for _ in range(2))
    causal = torch.ones(20, 20, dtype=torch.bool, device=device).tril()
    block = ((torch.rand(3, 1, 20, 20, generator=g).to(device) < 0.5)
             | torch.eye(20, dtype=torch.bool, device=device))
    for mask in (None, causal, block):
        got = attend(q, k, v, mask)
        torch.testing.assert_close(got, reference_attention(q, k, v, mask),
                                   atol=1e-5, rtol=1e-5)
        old = torch.nn.functional.scaled_dot_product_attention(
            q, k, v,
            attn_mask=causal if mask is None else mask,
            enable_gqa=H != n_kv)
        torch.testing.assert_close(got, old, atol=1e-6, rtol=1e-6)

    # fewer queries than keys
    q5 = q[:, :, :5]
    k9 = k[:, :, :9]
    v9 = v[:, :, :9]
    tail = torch.ones(5, 9, dtype=torch.bool,
                      device=device).tril(diagonal=4)
    torch.testing.assert_close(attend(q5, k9, v9, tail),
                               reference_attention(q5, k9, v9, tail),
                               atol=1e-5, rtol=1e-5)


def every_attention_path(model: Transformer) -> list[torch.Tensor]:
    """Logits and gradients of each way the model calls attention: the
    packed training layout (a boolean mask, forward and backward),
    causal training, a cached prefill, a cached pass of several tokens,
    a one-token prompt (a key length of 1), and the engine's passes
    (mtp/engine.py), plain and ragged."""
    from data import mtp_layout

    model.zero_grad()
    seqs = torch.randint(0, 97, (2, 24),
                         generator=torch.Generator().manual_seed(0))
    batch = mtp_layout(seqs, k=3, offset=1, n_regions=4, mask_id=96)
    packed = model(batch.input_ids, positions=batch.positions,
                   attn_mask=batch.attn_mask)
    causal = model(seqs)
    (packed.square().mean() + causal.square().mean()).backward()
    out = [packed, causal, model.layers[0].attn.wq.weight.grad,
           model.tok_emb.weight.grad]
    with torch.no_grad():
        cache = model.new_cache(2, 64)
        # a prefill, 4 cached tokens
        out.append(model(seqs[:, :10], cache=cache))
        out.append(model(seqs[:, 10:14], cache=cache))
        # a one-token prompt
        out.append(model(seqs[:1, :1], cache=model.new_cache(1, 8)))
        # the engine: a prefill, a ragged pass
        cache = new_cache(model, 2, 64)
        out.append(cached_forward(model, seqs[:, :10], cache))
        out.append(cached_forward(model, seqs[:, 10:16], cache,
                                  n_tokens=[6, 2]))
    return out


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)],
                         ids=["mha", "gqa", "mqa"])
def test_every_attention_path_takes_the_gpu_output_layout(heads, request):
    """On a GPU, attention outputs may come back transposed in memory
    (conftest.py's cuda_attention_layout emulates it): every path must
    give the same logits and gradients."""
    H, n_kv = heads
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=2,
                      n_heads=H, n_kv_heads=n_kv, ffn_dim=96)
    model = Transformer(cfg)
    plain = every_attention_path(model)
    request.getfixturevalue("cuda_attention_layout")
    for want, got in zip(plain, every_attention_path(model)):
        assert torch.equal(want, got)


def test_casting_the_model_keeps_rope_frequencies_in_float32():
    """`.to(bfloat16)` casts every floating-point buffer; the RoPE
    frequencies must stay exact, or a position's angle is off by up to
    0.4 radians below position 2048."""
    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=1,
                      n_heads=4, n_kv_heads=2, ffn_dim=96,
                      rope_theta=500000.0)
    model = Transformer(cfg).to(torch.bfloat16)
    assert model.tok_emb.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    assert torch.equal(model.inv_freq, rope_inv_freq(cfg))


def small_random_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2,
                                   n_heads=4, n_kv_heads=2,
                                   ffn_dim=96)).eval()


@pytest.mark.gpu
def test_kv_cache_matches_full_recompute(device):
    model = small_random_model().to(device)
    seq = torch.randint(0, 97, (2, 40)).to(device)
    with torch.no_grad():
        full = model(seq)
        # one token at a time
        cache = model.new_cache(2, 64)
        steps = [model(seq[:, t:t + 1], cache=cache)
                 for t in range(40)]
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)

        # several at a time, with rollbacks of junk "mask" entries in between
        # (as MTP decoding does)
        cache = model.new_cache(2, 64)
        t = 0
        for n in [5, 3, 1, 7, 4, 20]:
            got = model(seq[:, t:t + n], cache=cache)
            assert torch.allclose(got, full[:, t:t + n], atol=1e-5)
            junk = torch.randint(0, 97, (2, 6)).to(device)
            # pretend masks at positions t+n ..
            model(junk, cache=cache)
            cache.rollback(t + n)
            t += n

        # rows of different lengths: roll each row back to its own length
        cache = model.new_cache(2, 64)
        model(seq[:, :10], cache=cache)
        cache.rollback(torch.tensor([10, 6]))
        got = model(torch.stack([seq[0, 10:13], seq[1, 6:9]]),
                    cache=cache)
        assert torch.allclose(got[0], full[0, 10:13], atol=1e-5)
        assert torch.allclose(got[1], full[1, 6:9], atol=1e-5)
        assert cache.lengths.tolist() == [13, 9]


def test_positions_and_mask_arguments():
    """Explicit positions and masks: a shifted sequence with shifted
    positions gives the same logits as the original, and a block mask
    hides what it should."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=32, n_layers=2,
                                    n_heads=4, n_kv_heads=4,
                                    ffn_dim=64)).eval()
    seq = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        full = model(seq)
        # prepend junk that no token may attend to; positions continue as if it
        # were absent
        junk = torch.randint(0, 50, (1, 5))
        x = torch.cat([junk, seq], 1)
        pos = torch.cat([torch.zeros(1, 5, dtype=torch.long),
                         torch.arange(12)[None]], 1)
        i = torch.arange(17)
        mask = ((i[None, :] <= i[:, None])
                & ((i[None, :] >= 5) | (i[:, None] < 5)))
        got = model(x, positions=pos, attn_mask=mask)[:, 5:]
        assert torch.allclose(got, full, atol=1e-5)
        idx = torch.tensor([[3, 7]])
        assert torch.allclose(model(seq, output_index=idx),
                              full[:, [3, 7]],
                              atol=1e-6)


def test_cache_overflow_is_an_error():
    """A pass that does not fit is refused before anything is stored; one
    that fills the cache exactly fits."""
    model = Transformer(ModelConfig(vocab_size=20, dim=16, n_layers=1, n_heads=2,
                                    n_kv_heads=2, ffn_dim=32))
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="KV cache overflow: 9 slots needed"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    assert cache.lengths.tolist() == [0]
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    assert cache.lengths.tolist() == [8]


def test_a_cache_and_a_mask_are_one_too_many():
    """With a cache, attention is causal by slot: an attn_mask is refused."""
    model = small_random_model()
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="cannot be combined with a KV cache"):
        model(torch.zeros(1, 3, dtype=torch.long), attn_mask=mask,
              cache=model.new_cache(1, 8))
