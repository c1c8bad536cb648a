"""confadapt.py: every decoding mode against plain greedy and against its uncached definition,
decoded by both cached decoders: confadapt.generate (the lesson's) and mtp.engine.generate (ragged
passes and continuous batching, what every command decodes with).

Two tiny models: a random one (weights scaled up so its argmaxes are well separated) and a toy
MTP model trained here for a few seconds on arithmetic sequences (step 1 or 3, mod 16), so its
mask predictions are often, but not always, right and confident: drafts get accepted and
rejected, and ConfAdapt accepts chunks of varying size.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import confadapt
from confadapt import DecodeConfig, accept_confadapt, generate_uncached, verify_drafts
from model import ModelConfig, Transformer
from mtp.engine import decode_pass, generate, new_cache, prefill
from mtp.hf import from_pretrained, save_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MASK = 31
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4], [20, 21]]     # different lengths on purpose


pytestmark = pytest.mark.usefixtures("one_thread")            # conftest.py


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=96,
                      mask_token_id=MASK)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


TOY_V, TOY_MASK = 16, 16


@pytest.fixture(scope="module")
def toy_model():
    """Train a tiny MTP model on x_t = (start + step * t) mod 16, step 1 or 3: the prefix (when it
    has two tokens) determines the future, so mask predictions can be learned; with GT targets
    since the continuation is deterministic."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=TOY_V + 1, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=64, mask_token_id=TOY_MASK)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        start = torch.randint(0, TOY_V, (32, 1), generator=g)
        step = 1 + 2 * torch.randint(0, 2, (32, 1), generator=g)
        seq = (start + step * torch.arange(32)) % TOY_V                           # (32, 32)
        i, k = int(torch.randint(1, 24, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        x = torch.cat([seq[:, :i], torch.full((32, k - 1), TOY_MASK)], 1)        # prefix + k-1 masks
        loss = F.cross_entropy(model(x).flatten(0, 1), seq[:, 1:i + k].flatten())  # next token everywhere
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


TOY_PROMPTS = [[3, 4, 5], [9], [0, 3, 6, 9], [5, 6], [7, 10, 13, 0, 3, 6, 9, 12, 15]]


def on(device, *models):
    """The module's models, copied to the device of a `gpu`-marked test (conftest.py)."""
    moved = [m if device.type == "cpu" else copy.deepcopy(m).to(device) for m in models]
    return moved[0] if len(moved) == 1 else moved


def uncached(model, prompt, n, mode=DecodeConfig("greedy"), stop_ids=()):
    return generate_uncached(model, prompt, n, mode, stop_ids=stop_ids)


def tokens(model, prompts, n, mode, **kw):
    gens, _ = generate(model, prompts, n, mode, **kw)
    return [g.tokens for g in gens]


# ----------------------------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------------------------

def test_confadapt_rule():
    assert accept_confadapt([0.95, 0.99, 0.5, 0.99], 0.9) == 2       # leading run only
    assert accept_confadapt([0.2, 0.99, 0.99], 0.9) == 1             # never fewer than one
    assert accept_confadapt([0.9, 0.9], 0.9) == 2                    # "at least tau"
    assert accept_confadapt([0.5, 0.5, 0.5], 0.4) == 3
    # A saturated float32 softmax gives exactly 1.0; tau = 1.0 must still be plain greedy.
    probs = torch.tensor([[0.0, 40.0, 0.0], [0.0, 0.0, 60.0]]).softmax(-1).max(-1).values
    assert probs.tolist() == [1.0, 1.0]
    assert accept_confadapt(probs.tolist(), 1.0) == 1
    assert accept_confadapt(probs.tolist(), 0.999) == 2


def test_verify_drafts():
    assert verify_drafts([4, 5, 6], [4, 5, 6]) == 3
    assert verify_drafts([4, 9, 6], [4, 5, 6]) == 1                  # everything after a miss is dropped
    assert verify_drafts([9, 5], [4, 5]) == 0
    assert verify_drafts([], []) == 0


@pytest.mark.parametrize("bad", [DecodeConfig(tau=0.0), DecodeConfig(tau=1.5), DecodeConfig("static", k=0),
                                 DecodeConfig(k_max=0), DecodeConfig("beam")])
def test_bad_settings(random_model, bad):
    with pytest.raises(ValueError):
        generate(random_model, [[1, 2]], 4, bad)


def test_greedy_is_static_k_one():
    assert DecodeConfig("greedy") == DecodeConfig("static", k=1)
    assert DecodeConfig("static", k=1).describe() == "greedy"
    assert DecodeConfig("static", k=2).describe() == "static k=2"
    assert DecodeConfig("greedy").block == 1


def test_bad_inputs(random_model):
    with pytest.raises(ValueError, match="mask"):
        generate(_without_mask(random_model), [[1, 2]], 4, DecodeConfig("static", k=2))
    assert tokens(_without_mask(random_model), [[1, 2]], 4, DecodeConfig("greedy"))     # greedy needs none
    with pytest.raises(ValueError, match="context"):
        generate(random_model, [[1] * 96], 4, DecodeConfig("greedy"))
    with pytest.raises(ValueError, match="empty"):
        generate(random_model, [[]], 4, DecodeConfig("greedy"))
    with pytest.raises(ValueError, match="batch_size"):
        generate(random_model, [[1, 2]], 4, DecodeConfig("greedy"), batch_size=0)


def _without_mask(model):
    clone = Transformer(ModelConfig(**{**model.config.__dict__, "mask_token_id": None})).eval()
    clone.load_state_dict(model.state_dict())
    return clone


# ----------------------------------------------------------------------------------------------
# Every mode against its definition
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_greedy_matches_uncached_recompute(random_model, device):
    random_model = on(device, random_model)
    for p in PROMPTS:
        assert tokens(random_model, [p], 20, DecodeConfig("greedy")) == [uncached(random_model, p, 20)[0]]


@pytest.mark.parametrize("fixture", ["random_model", "toy_model"])
def test_tau_one_and_k_max_one_are_greedy(request, fixture):
    model = request.getfixturevalue(fixture)
    prompts = PROMPTS if fixture == "random_model" else TOY_PROMPTS
    greedy = tokens(model, prompts, 24, DecodeConfig("greedy"))
    for mode in [DecodeConfig("confadapt", tau=1.0, k_max=8), DecodeConfig("confadapt", tau=0.1, k_max=1)]:
        for p, want in zip(prompts, greedy):
            [gen], stats = generate(model, [p], 24, mode)
            assert gen.tokens == want
            assert stats.forward_passes == len(want)


EVERY_MODE = [DecodeConfig("greedy")] + [DecodeConfig("static", k=k) for k in (2, 3, 5)] + \
    [DecodeConfig("confadapt", tau=t, k_max=k) for t, k in [(0.3, 4), (0.6, 8), (0.9, 8), (0.99, 16)]] + \
    [DecodeConfig("lossless", k=k) for k in (2, 4, 8)]


def lesson_decoder(model, prompts, n, mode, stop_ids, batch_size):
    """confadapt.generate, batch_size prompts at a time -> ((tokens, chunk sizes) per prompt,
    None: it counts no passes)."""
    size = batch_size or len(prompts)
    out = []
    for i in range(0, len(prompts), size):
        out += confadapt.generate(model, prompts[i:i + size], n, mode, stop_ids=stop_ids)
    return out, None


def engine_decoder(model, prompts, n, mode, stop_ids, batch_size):
    """mtp.engine.generate -> ((tokens, chunk sizes) per prompt, forward passes)."""
    gens, stats = generate(model, prompts, n, mode, stop_ids=stop_ids, batch_size=batch_size)
    return [(g.tokens, g.chunk_sizes) for g in gens], stats.forward_passes


@pytest.mark.parametrize("decoder", [lesson_decoder, engine_decoder], ids=["lesson", "engine"])
@pytest.mark.parametrize("mode", EVERY_MODE, ids=lambda m: m.describe())
@pytest.mark.gpu
def test_generate_is_the_uncached_definition(random_model, toy_model, mode, decoder, device):
    """Both cached decoders give the tokens and chunk sizes of generate_uncached (the definition:
    one prompt, every pass recomputed), alone and batched: confadapt.generate (a KV cache, padded
    passes) and the engine (ragged passes, continuous batching)."""
    random_model, toy_model = on(device, random_model, toy_model)
    sizes = set()
    for model, prompts in [(random_model, PROMPTS), (toy_model, TOY_PROMPTS)]:
        for stop_ids in [(), {prompts[1][-1], 7}]:
            want = [uncached(model, p, 30, mode, stop_ids) for p in prompts]
            for batch_size in (1, 2, None):
                got, passes = decoder(model, prompts, 30, mode, stop_ids, batch_size)
                assert got == want, batch_size
                # the engine, one row at a time: its passes add up
                if batch_size == 1 and passes is not None:
                    assert passes == sum(len(chunks) for _, chunks in want)
            sizes |= {n for _, chunks in want for n in chunks[:-1]}
    if mode.kind == "static":
        assert sizes == {mode.block}
    else:                                                  # chunks of varied sizes: the rule was at work
        assert len(sizes) >= min(3, mode.block), sizes


@pytest.mark.gpu
def test_confadapt_accepts_chunks_on_a_trained_toy(toy_model, device):
    _, stats = generate(on(device, toy_model), TOY_PROMPTS, 30, DecodeConfig("confadapt", tau=0.9, k_max=8))
    assert stats.effective_k > 1.5


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.gpu
def test_lossless_is_greedy_on_random_models(random_model, seed, k, device):
    random_model = on(device, random_model)
    torch.manual_seed(seed)
    prompts = [torch.randint(0, 30, (n,)).tolist() for n in (1, 3, 6)]
    mode = DecodeConfig("lossless", k=k)
    for p in prompts:
        [gen], stats = generate(random_model, [p], 20, mode)
        assert gen.tokens == uncached(random_model, p, 20)[0]
        # one pass per chunk of the definition: fewer than greedy's 20 where drafts held
        assert stats.forward_passes == len(uncached(random_model, p, 20, mode)[1])


def test_lossless_is_greedy_and_faster_on_a_trained_toy(toy_model):
    n = 40
    greedy, _ = generate(toy_model, TOY_PROMPTS, n, DecodeConfig("greedy"))
    for k in (4, 8):
        gens, stats = generate(toy_model, TOY_PROMPTS, n, DecodeConfig("lossless", k=k))
        assert [g.tokens for g in gens] == [g.tokens for g in greedy]
        assert [g.tokens for g in greedy] == [uncached(toy_model, p, n)[0] for p in TOY_PROMPTS]
        assert stats.row_passes < 0.7 * stats.tokens                      # fewer passes than greedy
        assert any(1 < size < k for size in stats.accept_hist)            # partial acceptances happened


# ----------------------------------------------------------------------------------------------
# The cache, stop tokens, batching, statistics
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def test_cache_after_rollbacks_matches_full_recompute(random_model):
    """Two rows of different lengths: passes with masks, rolled back to different lengths per row,
    then the cached logits of the real continuation equal a full recompute."""
    seqs = [torch.randint(0, 30, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    cache = new_cache(random_model, 2, 96)
    prefill(random_model, cache, {0: seqs[1][:30], 1: seqs[1][:3]}, MASK)
    prefill(random_model, cache, {0: seqs[0][:8]}, MASK)         # row 0 starts afresh (a prompt joins)
    assert cache.lengths.tolist() == [7, 2]                      # caches 7 and 2 tokens
    done = [7, 2]
    for step in [(3, 5), (1, 6), (6, 2)]:                                          # tokens fed per row
        inputs = [seqs[b][done[b]:done[b] + step[b]] + [MASK] * 4 for b in range(2)]
        decode_pass(random_model, cache, inputs, [0, 0], [1, 1], MASK)
        done = [done[b] + step[b] for b in range(2)]
        cache.rollback(torch.tensor(done))                                         # drop masks and padding
    inputs = [seqs[b][done[b]:done[b] + 5] for b in range(2)]
    got = decode_pass(random_model, cache, inputs, [0, 0], [5, 5], MASK)           # (2, 5, V)
    for b in range(2):
        full = random_model(torch.tensor([seqs[b][:done[b] + 5]]))[0, done[b]:]
        assert torch.allclose(got[b], full, atol=1e-5)


def test_stop_token_in_the_middle_of_a_chunk(random_model):
    mode = DecodeConfig("static", k=4)
    [gen], _ = generate(random_model, [PROMPTS[0]], 24, mode)
    # a token strictly inside a chunk (not its first or last) that does not occur before it
    ends = gen.boundaries
    cut, c = next((i, c) for c in range(1, len(ends)) for i in range(ends[c - 1] + 1, ends[c] - 1)
                  if gen.tokens[i] not in gen.tokens[:i])
    stop = gen.tokens[cut]
    [stopped], stats = generate(random_model, [PROMPTS[0]], 24, mode, stop_ids={stop})
    assert stopped.tokens == gen.tokens[:cut + 1] and stopped.stopped and not gen.stopped
    assert stopped.chunk_sizes == gen.chunk_sizes[:c] + [cut + 1 - ends[c - 1]]     # last chunk cut short
    assert stats.tokens == cut + 1
    assert (stopped.tokens, stopped.chunk_sizes) == uncached(random_model, PROMPTS[0], 24, mode, {stop})


MODES = [DecodeConfig("greedy"), DecodeConfig("static", k=3), DecodeConfig("confadapt", tau=0.5, k_max=6),
         DecodeConfig("lossless", k=4)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.describe())
@pytest.mark.gpu
def test_batched_equals_one_at_a_time(random_model, toy_model, mode, device):
    random_model, toy_model = on(device, random_model, toy_model)
    for model, prompts in [(random_model, PROMPTS), (toy_model, TOY_PROMPTS)]:
        stop_ids = {prompts[0][0]}                       # some rows stop early: the batch shrinks
        alone = [generate(model, [p], 25, mode, stop_ids=stop_ids)[0][0] for p in prompts]
        batched, stats = generate(model, prompts, 25, mode, stop_ids=stop_ids)
        assert stats.batch_size == len(prompts)
        assert stats.forward_passes == max(g.forward_passes for g in batched)
        # Two rows at a time: a finished row's place goes to the next waiting prompt.
        joined, joined_stats = generate(model, prompts, 25, mode, stop_ids=stop_ids, batch_size=2)
        assert joined_stats.batch_size == 2
        assert max(g.forward_passes for g in batched) <= joined_stats.forward_passes < stats.row_passes
        for a, b, j in zip(alone, batched, joined):
            assert (b.tokens, b.chunk_sizes, b.stopped) == (a.tokens, a.chunk_sizes, a.stopped)
            assert (j.tokens, j.chunk_sizes, j.stopped) == (a.tokens, a.chunk_sizes, a.stopped)


def test_statistics_add_up(toy_model):
    gens, stats = generate(toy_model, TOY_PROMPTS, 30, DecodeConfig("confadapt", tau=0.9, k_max=8))
    assert stats.tokens == sum(len(g.tokens) for g in gens)
    assert stats.row_passes == sum(g.forward_passes for g in gens) == sum(stats.accept_hist.values())
    assert sum(n * c for n, c in stats.accept_hist.items()) == stats.tokens
    assert stats.effective_k == pytest.approx(stats.tokens / stats.row_passes)
    assert stats.seconds > stats.prefill_seconds > 0 and stats.tokens_per_second > 0
    # Positions fed: each pass feeds the last pass's tokens (the first: the prompt's last) plus
    # k_max - 1 masks, fewer when fewer tokens are still wanted; padding of the batch not counted.
    fed = 0
    for g in gens:
        for i, n in enumerate(g.chunk_sizes):
            fed += (g.chunk_sizes[i - 1] if i else 1) + min(8, 30 - sum(g.chunk_sizes[:i])) - 1
    assert stats.fed_tokens == fed
    _, greedy = generate(toy_model, TOY_PROMPTS, 30, DecodeConfig("greedy"))
    assert greedy.fed_tokens == greedy.tokens
    for g in gens:
        assert len(g.tokens) == 30 and g.boundaries[-1] == 30 and sum(g.chunk_sizes) == 30
        assert max(g.chunk_sizes) <= 8


def test_generation_stops_at_the_end_of_the_context(random_model):
    prompt = [1] * 90                                          # max_seq_len is 96
    for mode in MODES:
        [gen], _ = generate(random_model, [prompt], 50, mode)
        assert len(gen.tokens) == 6
        [(tokens, _)] = confadapt.generate(random_model, [prompt], 50, mode)
        assert tokens == gen.tokens


# ----------------------------------------------------------------------------------------------
# The command line, and the benchmark (benchmarks/bench_modes.py, run as a script)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--tau", "1.5"], "tau"),
    (["--tau", "0"], "tau"),
    (["--static-k", "0"], "--static-k: must be at least 1"),
    (["--k-max", "0"], "--k-max: must be at least 1"),
    (["--static-k", "2", "--lossless"], "not allowed with"),
    (["--static-k", "2", "--tau", "0.5"], "ConfAdapt only"),
])
def test_cli_bad_arguments(capsys, argv, message):
    assert confadapt.main(["--model", "/nonexistent", "--prompt", "x"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_missing_model(capsys):
    assert confadapt.main(["--model", "/nonexistent", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model /nonexistent: no such folder") and err.count("\n") == 1


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny random model with the toy tokenizer, saved with and without a <mask> token."""
    from tasks.toy import toy_tokenizer
    from model import add_mask_token

    dirs = {}
    for name in ("plain", "mtp"):
        tok = toy_tokenizer()
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=tok.n_vocab, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                        ffn_dim=32, max_seq_len=48, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id))
        if name == "mtp":
            add_mask_token(model, tok)
        path = tmp_path_factory.mktemp(name)
        save_pretrained(model, path)
        tok.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


def test_cli_json_matches_generate(model_dirs, capsys):
    from mtp.tokenizer import Tokenizer

    path = model_dirs["mtp"]
    for flags, mode in [([], DecodeConfig("confadapt", tau=0.9, k_max=16)),
                        (["--static-k", "3"], DecodeConfig("static", k=3)),
                        (["--lossless", "--k-max", "4"], DecodeConfig("lossless", k=4)),
                        (["--greedy"], DecodeConfig("greedy"))]:
        assert confadapt.main(["--model", path, "--prompt", "1 2 3", "--max-new-tokens", "9", "--json"] + flags) == 0
        out = json.loads(capsys.readouterr().out)
        assert {"text", "tokens", "forward_passes", "effective_k", "seconds"} <= set(out)
        model, tok = from_pretrained(path), Tokenizer.from_pretrained(path)
        prompt = [tok.bos_id] + tok.encode("1 2 3")
        [gen], _ = generate(model, [prompt], 9, mode, stop_ids=tok.stop_ids)
        assert out["tokens"] == gen.tokens and out["text"] == tok.decode(gen.tokens)
        assert out["forward_passes"] == gen.forward_passes and out["mode"] == mode.describe()


def test_cli_text_output_and_png(model_dirs, capsys, tmp_path):
    png = tmp_path / "chunks.png"
    assert confadapt.main(["--model", model_dirs["mtp"], "--prompt", "1 2", "--max-new-tokens", "5",
                           "--static-k", "2", "--color", "never", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 2[") and "effective k" in out and "forward passes  3" in out
    assert png.stat().st_size > 1000


def test_cli_errors_from_the_model(model_dirs, capsys):
    assert confadapt.main(["--model", model_dirs["plain"], "--prompt", "1 2"]) == 2
    assert "no mask token" in capsys.readouterr().err
    assert confadapt.main(["--model", model_dirs["plain"], "--prompt", "1 2", "--greedy", "--json",
                           "--max-new-tokens", "3"]) == 0                     # greedy needs no mask
    out = json.loads(capsys.readouterr().out)
    # one token a pass
    assert out["mode"] == "greedy" and out["forward_passes"] == len(out["tokens"]) > 0
    assert out["chunk_sizes"] == [1] * len(out["tokens"])
    assert confadapt.main(["--model", model_dirs["mtp"], "--prompt", " ".join(["7"] * 60)]) == 2
    err = capsys.readouterr().err
    assert "does not fit the context" in err and err.count("\n") == 1


def bench_modes(*args) -> str:
    """benchmarks/bench_modes.py run as a script -> its output."""
    script = os.path.join(ROOT, "benchmarks", "bench_modes.py")
    run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_bench_json(model_dirs):
    """Every mode at every batch size decodes the same rows; greedy is the speed-up's base, and
    lossless prints greedy's tokens."""
    out = bench_modes("--model", model_dirs["mtp"], "--prompt", "1 2 3", "--prompt", "4",
                      "--max-new-tokens", "6", "--batch-sizes", "1", "2", "--taus", "0.5", "0.9",
                      "--repeats", "1", "--latency-max", "3", "--json", "--threads", "1")
    report = json.loads(out)
    rows = report["results"]
    modes = {r["mode"] for r in rows}
    assert modes == {"greedy", "static k=4", "confadapt tau=0.5 k_max=16", "confadapt tau=0.9 k_max=16",
                     "lossless k=16"}
    assert len(rows) == 10 and {r["batch_size"] for r in rows} == {1, 2}
    assert set(report["latency_seconds"]) == {"1", "2"}
    assert set(report["latency_seconds"]["2"]) == {"1", "2", "3"}
    assert all(r["speedup"] == 1.0 for r in rows if r["kind"] == "greedy")
    tokens = {(r["batch_size"], r["kind"]): r["tokens"] for r in rows}
    assert tokens[1, "greedy"] == tokens[2, "greedy"] == tokens[1, "lossless"] == tokens[2, "lossless"]
    assert all(r["equals_greedy"] for r in rows if r["kind"] in ("greedy", "lossless"))


def test_bench_table(model_dirs):
    out = bench_modes("--model", model_dirs["mtp"], "--prompt", "1 2 3", "--max-new-tokens", "4",
                      "--batch-sizes", "1", "--taus", "0.9", "--repeats", "1", "--latency-max", "2",
                      "--threads", "1")
    assert "speed-up" in out and "forward-pass latency" in out
    # a header, one line per mode (greedy, static, ConfAdapt, lossless), the latency curve
    assert len(out.splitlines()) == 1 + 4 + 3
