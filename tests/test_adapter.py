"""The gated mask adapter: it changes the <mask> predictions and nothing
else, exactly.

Every test gives the adapter non-zero weights (a fresh one is zero and would
prove nothing) and compares in float32 against the untuned model, bit for
bit, with torch.equal.
"""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import confadapt
from confadapt import DecodeConfig
from data import MASK, mtp_layout
from tasks.word_problems import word_problem_tokenizer
from adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_off_teacher, adapter_state,
                     add_mask_adapter, gated_mtp_loss, load_mask_adapter,
                     save_mask_adapter)
from distill import frozen_teacher, mtp_loss
from model import KVCache, ModelConfig, Transformer, add_mask_token, slots_of
from mtp.cli import load_model
from mtp.engine import cached_forward, generate, new_cache
from mtp.hf import from_pretrained, save_pretrained

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")

MASK_ID = 63


def trained_looking(model):
    """Random, non-zero adapter weights, as if trained."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)


def untuned_and_adapted(targets=("wq", "wk", "wv", "wo", "gate", "up", "down"),
                        seed=0, kind="shared"):
    """A tiny random model with <mask> (the untuned model), and a copy with a
    trained-looking gated adapter: one shared <mask> embedding, or one per slot
    ("slots", 3 of them)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, ffn_dim=48, mask_token_id=MASK_ID,
                      max_seq_len=128)
    untuned = Transformer(cfg).eval()
    adapted = copy.deepcopy(untuned)
    add_mask_adapter(adapted, rank=4, alpha=8.0, targets=targets,
                     slots=3 if kind == "slots" else 0)
    trained_looking(adapted)
    return untuned, adapted


KINDS = ["shared", "slots"]


def packed_batch(seed=1, k=4):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(1, MASK_ID, (3, 40), generator=g)
    return mtp_layout(seqs, k=k, offset=1, n_regions=6, mask_id=MASK_ID)


def packed_logits(model, b):
    return model(b.input_ids, positions=b.positions, attn_mask=b.attn_mask)


def test_only_the_adapter_and_the_mask_embedding_train():
    _, adapted = untuned_and_adapted(targets=("wq", "down"))
    trained = sorted(n for n, p in adapted.named_parameters()
                     if p.requires_grad)
    assert trained == sorted(adapter_state(adapted)) == [
        "layers.0.attn.wq.adapter.down",
        "layers.0.attn.wq.adapter.up",
        "layers.0.mlp.down.adapter.down",
        "layers.0.mlp.down.adapter.up",
        "layers.1.attn.wq.adapter.down",
        "layers.1.attn.wq.adapter.up",
        "layers.1.mlp.down.adapter.down",
        "layers.1.mlp.down.adapter.up",
        "mask_embedding"]
    opt = adapted.configure_optimizer(1e-3, 0.1)
    assert (sum(len(g["params"]) for g in opt.param_groups)
            == len(trained))


def test_a_fresh_adapter_is_the_untuned_model():
    untuned = untuned_and_adapted()[0]
    fresh = copy.deepcopy(untuned)
    add_mask_adapter(fresh, rank=4, alpha=8.0)
    b = packed_batch()
    # at the mask slots too
    assert torch.equal(packed_logits(fresh, b), packed_logits(untuned, b))


@pytest.mark.parametrize("kind", KINDS)
def test_ordinary_positions_of_a_packed_row_are_the_untuned_models(kind):
    untuned, adapted = untuned_and_adapted(kind=kind)
    b = packed_batch()
    ours = packed_logits(adapted, b)
    theirs = packed_logits(untuned, b)
    ordinary = b.kind != MASK
    assert torch.equal(ours[ordinary], theirs[ordinary])
    # the adapter does act
    assert (ours[~ordinary] - theirs[~ordinary]).abs().amax() > 0.1
    # switched off: untuned
    off = adapted(b.input_ids, positions=b.positions, attn_mask=b.attn_mask,
                  use_adapter=False)
    assert torch.equal(off, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_ordinary_positions_of_cached_ragged_passes_are_the_untuned_models(kind):
    """Prefill, then passes that feed accepted tokens plus masks, rows
    feeding different numbers: the cache entries and logits of the accepted
    tokens are the untuned model's."""
    untuned, adapted = untuned_and_adapted(kind=kind)
    caches = [new_cache(m, 3, 64) for m in (untuned, adapted)]
    prompts = torch.randint(1, MASK_ID, (3, 7),
                            generator=torch.Generator().manual_seed(2))
    for model, cache in zip((untuned, adapted), caches):
        cached_forward(model, prompts, cache)

    # (accepted per row, masks)
    passes = [([2, 3, 1], 4), ([1, 2, 2], 3)]
    for accepted, n_mask in passes:
        fed = torch.randint(1, MASK_ID, (3, max(accepted) + n_mask))
        n_tokens = []
        for row, n in enumerate(accepted):
            fed[row, n:n + n_mask] = MASK_ID
            n_tokens.append(n + n_mask)
        outs = [cached_forward(m, fed, c, n_tokens=n_tokens)
                for m, c in zip((untuned, adapted), caches)]
        for row, n in enumerate(accepted):
            assert torch.equal(outs[0][row, :n], outs[1][row, :n])
            assert not torch.equal(outs[0][row, n:n + n_mask],
                                   outs[1][row, n:n + n_mask])
        # roll the mask slots back
        for cache in caches:
            cache.rollback(cache.lengths - n_mask)

    assert torch.equal(caches[0].lengths, caches[1].lengths)
    for kv in ("k", "v"):
        used = int(caches[0].lengths.min())
        assert torch.equal(getattr(caches[0], kv)[:, :, :, :used],
                           getattr(caches[1], kv)[:, :, :, :used])


def test_the_adapter_off_teacher_is_a_frozen_copy_of_the_untuned_model():
    untuned, adapted = untuned_and_adapted()
    b = packed_batch()
    # mtp_loss's teacher pass, seen from inside: the same input, the same logits
    seen = {}
    for name, teacher in (("copied", frozen_teacher(untuned)),
                          ("off", adapter_off_teacher(adapted))):
        def spy(*args, teacher=teacher, name=name, **kwargs):
            seen[name] = teacher(*args, **kwargs)
            return seen[name]

        mtp_loss(adapted, spy, b)
    assert torch.equal(seen["off"], seen["copied"])
    # the student itself still computes with its adapter
    assert not torch.equal(packed_logits(adapted, b), packed_logits(untuned, b))


def rows_with_padding(k):
    """Rows that end early (EOS 0 in two of them) and train only on their
    second half: padding, unsupervised regions and untrained targets."""
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(1, MASK_ID, (3, 40), generator=g)
    seqs[1, 26] = 0
    seqs[2, 9] = 0
    trained = torch.arange(40).expand(3, 40) >= 12
    return mtp_layout(seqs, k=k, offset=2, n_regions=6, mask_id=MASK_ID,
                      eos_id=0, trained=trained)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("mode", ["hard", "soft", "gt"])
def test_gated_mtp_loss_is_mtp_loss_with_the_adapter_off_teacher(mode, k):
    """The adapter's training loss computes the ground-truth rows once,
    without gradient, and only the mask slots with it; its loss, statistics
    and gradients are mtp_loss's with the adapter-off teacher, up to float32
    rounding (the passes have other shapes)."""
    _, adapted = untuned_and_adapted()
    b = rows_with_padding(k)
    trained = [p for p in adapted.parameters() if p.requires_grad]
    packed, packed_stats = mtp_loss(adapted, adapter_off_teacher(adapted), b, mode=mode)
    packed_grads = torch.autograd.grad(packed, trained)
    gated, gated_stats = gated_mtp_loss(adapted, b, mode=mode)
    gated_grads = torch.autograd.grad(gated, trained)

    assert gated.item() == pytest.approx(packed.item(), rel=1e-5, abs=1e-6)
    assert gated_stats["acc"] == packed_stats["acc"]
    assert gated_stats["n_pred"] == packed_stats["n_pred"] > 0
    for ours, theirs in zip(gated_grads, packed_grads):
        scale = theirs.abs().max()
        assert scale > 0
        assert (ours - theirs).abs().max() <= 1e-4 * scale


def test_gated_mtp_loss_runs_only_the_mask_slots_with_gradient(monkeypatch):
    """Three passes: the N ground-truth tokens, base model, no gradient; the
    M (k-1) slots with the adapter and gradient; the slots again for the
    teacher, adapter off, no gradient."""
    _, adapted = untuned_and_adapted()
    b = rows_with_padding(k=4)
    passes = []
    forward = Transformer.forward

    def spy(model, tokens, **kwargs):
        use_adapter = kwargs.get("use_adapter", True)
        passes.append((tokens.shape[1], torch.is_grad_enabled(), use_adapter))
        return forward(model, tokens, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    gated_mtp_loss(adapted, b)
    assert passes == [(40, False, False), (6 * 3, True, True), (6 * 3, False, False)]


def rows_without_a_mask():
    """Rows that end (EOS, token 0) before the first region does: every slot is padding, so the
    micro-batch holds no <mask> at all."""
    seqs = torch.randint(1, MASK_ID, (3, 40), generator=torch.Generator().manual_seed(2))
    seqs[:, 1] = 0
    return mtp_layout(seqs, k=4, offset=3, n_regions=6, mask_id=MASK_ID, eos_id=0)


@pytest.mark.parametrize("adapter", ["shared", "slots", None])
def test_a_micro_batch_without_a_mask_gives_every_trained_tensor_a_zero_gradient(adapter):
    """Under FSDP2 (or any gradient reduction) a process whose micro-batch leaves a trained
    tensor without .grad skips that tensor's reduction while the others wait for it: a hang.
    So a micro-batch with no <mask> must still give every trained tensor a gradient, zeros."""
    untuned, adapted = untuned_and_adapted(kind=adapter or "shared")
    b = rows_without_a_mask()
    assert not (b.input_ids == MASK_ID).any()
    if adapter:
        student = adapted
        loss, _ = gated_mtp_loss(student, b)
    else:
        student = untuned.train()
        loss, _ = mtp_loss(student, frozen_teacher(untuned), b)
    loss.backward()
    trained = {n: p for n, p in student.named_parameters() if p.requires_grad}
    assert trained
    missing = [n for n, p in trained.items() if p.grad is None]
    assert missing == []
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in trained.values())


def test_gated_mtp_loss_under_fsdp2_mixed_precision(monkeypatch):
    """FSDP2's mixed precision, emulated on one CPU process: every weight
    computes in bfloat16 (so bfloat16 keys), while new_cache sees the float32
    sharded weights (so a float32 cache). The slots' pass must read the cache
    in the keys' dtype; no autocast here to cast for it."""
    _, adapted = untuned_and_adapted()
    adapted.to(torch.bfloat16)

    def float32_cache(model, batch_size, max_len=None):
        return KVCache(model.config, batch_size, max_len, dtype=torch.float32)

    monkeypatch.setattr(Transformer, "new_cache", float32_cache)
    loss, _ = gated_mtp_loss(adapted, rows_with_padding(k=4))
    loss.backward()
    grads = [p.grad for p in adapted.parameters() if p.requires_grad]
    assert torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_and_lossless_print_the_untuned_models_greedy_tokens(batch_size, kind):
    untuned, adapted = untuned_and_adapted(kind=kind)
    g = torch.Generator().manual_seed(3)
    # prompts of different lengths
    prompts = [torch.randint(1, MASK_ID, (n,), generator=g).tolist()
               for n in (3, 9, 5, 12)]
    reference, _ = generate(untuned, prompts, 24, DecodeConfig("static", k=1),
                            batch_size=batch_size)
    for mode in (DecodeConfig("static", k=1), DecodeConfig("lossless", k=4)):
        gens, _ = generate(adapted, prompts, 24, mode, batch_size=batch_size)
        assert [x.tokens for x in gens] == [x.tokens for x in reference]
    static, _ = generate(adapted, prompts, 24, DecodeConfig("static", k=4),
                         batch_size=batch_size)
    # its guesses are the adapter's
    assert [x.tokens for x in static] != [x.tokens for x in reference]


def test_save_and_load_round_trip(tmp_path):
    untuned, adapted = untuned_and_adapted(targets=("wv", "up"))
    base = tmp_path / "base"
    save_pretrained(untuned, base)
    folder = tmp_path / "adapter"
    save_mask_adapter(adapted, folder, base)
    assert (sorted(p.name for p in folder.iterdir())
            == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS]))
    saved = load_file(str(folder / ADAPTER_WEIGHTS))
    # nothing of the base
    assert set(saved) == set(adapter_state(adapted))
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["adapter_type"] == "gated-mask-lora"
    assert config["base_model"] == "../base"
    loaded = load_mask_adapter(from_pretrained(base), folder)
    b = packed_batch()
    assert torch.equal(packed_logits(loaded, b), packed_logits(adapted, b))


def test_load_model_reads_base_and_adapter(tmp_path, capsys):
    """mtp.cli.load_model (every command's loader) on an adapter folder: the
    base model from the folder it names, <mask> added to it, then the
    adapter."""
    tok = word_problem_tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.n_vocab, dim=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, ffn_dim=48)
    base = Transformer(cfg).eval()
    save_pretrained(base, tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    tuned = copy.deepcopy(base)
    mask_id = add_mask_token(tuned, copy.deepcopy(tok))
    add_mask_adapter(tuned, rank=2, alpha=4.0)
    trained_looking(tuned)
    save_mask_adapter(tuned, tmp_path / "adapter", tmp_path / "base")

    model, tokenizer, loaded_mask_id, _ = load_model(tmp_path / "adapter")
    assert loaded_mask_id == mask_id
    assert tokenizer.special_tokens["<mask>"] == mask_id
    x = torch.tensor([[1, 5, 9, mask_id, mask_id]])
    assert torch.equal(model(x), tuned(x))

    # confadapt.py on the adapter folder: its lossless text is the base
    # model's greedy text.
    texts = []
    for folder, mode in ((tmp_path / "base", "--greedy"),
                         (tmp_path / "adapter", "--lossless")):
        argv = ["--model", str(folder), "--prompt", "Tom has 3 apples.",
                "--max-new-tokens", "12", mode, "--json", "--dtype", "float32"]
        assert confadapt.main(argv) == 0
        texts.append(json.loads(capsys.readouterr().out)["tokens"])
    assert texts[0] == texts[1]


def test_a_loaded_adapter_stays_float32_on_a_bfloat16_base(tmp_path):
    """The update is computed in float32 and added to the base's bfloat16
    output: close to the float32 model's, and only at the mask rows."""
    untuned, adapted = untuned_and_adapted()
    save_pretrained(untuned, tmp_path / "base")
    save_mask_adapter(adapted, tmp_path / "adapter", tmp_path / "base")
    base = from_pretrained(tmp_path / "base", dtype=torch.bfloat16)
    loaded = load_mask_adapter(base, tmp_path / "adapter")
    names = adapter_state(loaded)
    dtypes = {n: p.dtype for n, p in loaded.named_parameters()}
    assert {dtypes[n] for n in names} == {torch.float32}
    assert {d for n, d in dtypes.items() if n not in names} == {torch.bfloat16}
    assert not any(p.requires_grad for p in loaded.parameters())

    b = packed_batch()
    ours = packed_logits(loaded, b)
    assert ours.dtype == torch.bfloat16
    is_mask = b.kind == MASK
    untuned_bf16 = from_pretrained(tmp_path / "base", dtype=torch.bfloat16)
    assert torch.equal(ours[~is_mask], packed_logits(untuned_bf16, b)[~is_mask])
    reference = packed_logits(adapted, b)
    assert (ours.float() - reference)[is_mask].abs().max() < 0.1 * reference.abs().max()


# ---- one <mask> embedding per slot ----------------------------------------

def test_a_masks_slot_counts_the_masks_just_before_it_in_its_row():
    is_mask = torch.tensor([[0, 1, 1, 1, 0, 1],
                            [1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    assert slots_of(is_mask).tolist() == [[0, 1, 2, 3, 0, 1],
                                          [1, 2, 0, 0, 1, 0]]


def test_each_slot_reads_its_own_embedding_in_decoding_and_in_training(monkeypatch):
    """Decoding: slot j of a row's run of <mask>s gets embedding j, whatever
    the slot positions are. Training: gated_mtp_loss's slots sit region after
    region, so it numbers them itself (1 .. k-1 in each region)."""
    _, adapted = untuned_and_adapted(kind="slots")
    embedding = adapted.mask_embedding
    tokens = torch.tensor([[5, MASK_ID, MASK_ID, MASK_ID, 7, MASK_ID]])
    x, rows = adapted.embed(tokens)
    assert rows.tolist() == [1, 2, 3, 5]
    for position, slot in ((1, 0), (2, 1), (3, 2), (5, 0)):
        assert torch.equal(x[0, position], embedding[slot])
    # three slots, each its own
    assert not torch.equal(embedding[0], embedding[1])

    seen = []
    original = Transformer.forward

    def spy(model, tokens, **kwargs):
        seen.append(kwargs.get("mask_slots"))
        return original(model, tokens, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    loss, _ = gated_mtp_loss(adapted, packed_batch(k=4))
    loss.backward()
    numbered = [s for s in seen if s is not None]
    assert numbered and all(s[0].tolist() == [1, 2, 3] * 6 for s in numbered)
    # every slot's embedding trains
    assert (embedding.grad.abs().sum(-1) > 0).all()


def test_slot_embeddings_are_saved_and_loaded_and_more_slots_are_refused(tmp_path):
    untuned, adapted = untuned_and_adapted(kind="slots")
    base = tmp_path / "base"
    save_pretrained(untuned, base)
    save_mask_adapter(adapted, tmp_path / "adapter", base)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["mask_slots"] == 3
    loaded = load_mask_adapter(from_pretrained(base), tmp_path / "adapter")
    assert torch.equal(loaded.mask_embedding, adapted.mask_embedding)
    assert loaded.mask_embedding.shape == (3, 32)
    tokens = torch.tensor([[5, 9, MASK_ID, MASK_ID, MASK_ID]])
    assert torch.equal(loaded(tokens), adapted(tokens))
    # k = 4 feeds at most 3 masks; k = 5 would feed a fourth, untrained slot
    generate(loaded, [[5, 9]], 8, DecodeConfig("confadapt", tau=0.5, k_max=4))
    with pytest.raises(ValueError, match="trained with 3 <mask> slots"):
        generate(loaded, [[5, 9]], 8, DecodeConfig("confadapt", tau=0.5, k_max=5))
