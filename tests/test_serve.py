"""serve.py: the OpenAI-compatible server, run in this process on a free loopback port over a
tiny model built here, and spoken to with the real `openai` client.

Every test has a watchdog (a hang ends the run with every thread's stack, rather than stalling
it), every client call a timeout, and the servers listen on 127.0.0.1 only."""
import asyncio
import concurrent.futures
import contextlib
import faulthandler
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import serve  # noqa: E402
from conftest import tiny_model  # noqa: E402
from model import add_mask_token  # noqa: E402
from mtp.hf import save_pretrained  # noqa: E402
from confadapt import DecodeConfig  # noqa: E402
from mtp.engine import Row  # noqa: E402
from mtp.load_rule import Acceptance, PassCosts, measure_tile  # noqa: E402
from mtp.openai_api import TextStream  # noqa: E402
from mtp.tokenizer import whole_token_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(ROOT, "models", "smollm2")
# every test ends within this many seconds, or the run ends with a traceback of every thread
WATCHDOG_S = 180
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def write_model(folder, with_mask=True, context=1024):
    """A tiny random chat model (chatml tokens, so `--format auto` is chatml) whose stop tokens
    are never the argmax, so a row runs to its budget unless a stop string or the client ends
    it. Its head is scaled so that predictions are confident and ConfAdapt keeps several."""
    tok = whole_token_tokenizer(["hello", " world", " the", " cat", " sat", "é", "日本"])
    for text in CHAT_TOKENS:
        tok.add_special_token(text)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    # with a <mask>, one spare row for it
    model = tiny_model(tok.n_vocab + with_mask, max_seq_len=context, **ids)
    if with_mask:
        add_mask_token(model, tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(32)
        for text in ("<|eos|>", *CHAT_TOKENS):
            model.lm_head.weight[tok.token_id(text)] = 0
    save_pretrained(model, folder)
    tok.save_pretrained(folder)
    return str(folder)


@contextlib.contextmanager
def running_server(argv):
    """serve.py's app and decoder over uvicorn in a thread, on a free 127.0.0.1 port ->
    (base URL, decoder)."""
    args = serve.parser().parse_args(argv)
    app, decoder = serve.build(args)
    decoder.thread.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start in 30 s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", decoder
    finally:
        server.should_exit = True
        thread.join(10)
        decoder.running = False
        decoder.thread.join(10)
        sock.close()


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return {"mtp": write_model(root / "mtp"), "plain": write_model(root / "plain", False)}


@pytest.fixture(scope="module")
def server(folders):
    argv = ["--model", folders["mtp"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "8", "--k-max", "4"]
    with running_server(argv) as (url, decoder):
        yield url, decoder


def chat(c, text="hello world", **extra):
    """A chat completion's text and usage, with the decoding options as extra body fields."""
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                  max_tokens=extra.pop("max_tokens", 24), extra_body=extra)
    return r.choices[0].message.content, r.usage


def post(url, path, body, headers=None):
    """A raw POST -> (status, JSON body, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def metric(url, name) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


# ---- streaming text ---------------------------------------------------------------------------

def test_text_stream_never_splits_a_utf8_character():
    tok = whole_token_tokenizer([])
    # "é" is two bytes, each its own token here
    ids = [tok.encode("a")[0], *[tok.mergeable_ranks[bytes([b])] for b in "é".encode()]]
    text = TextStream(tok, [])
    assert text.add(ids[:2]) == ("a", False)
    assert text.add(ids[2:]) == ("é", False)


def test_text_stream_holds_the_start_of_a_stop_string_and_cuts_at_it():
    tok = whole_token_tokenizer([])
    text = TextStream(tok, ["END"])
    assert text.add(tok.encode("xE")) == ("x", False)
    assert text.add(tok.encode("N")) == ("", False)
    # not the stop string after all: the held text goes out
    assert text.add(tok.encode("o")) == ("ENo", False)
    assert text.add(tok.encode("yEND and more")) == ("y", True)


# ---- the API ----------------------------------------------------------------------------------

def test_models_health_and_metrics(server):
    url, _ = server
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    assert metric(url, "mtp_live_rows") == 0


@pytest.mark.parametrize("mode", ["greedy", "lossless", "confadapt", "static"])
def test_streaming_equals_non_streaming(server, mode):
    url, _ = server
    c = client(url)
    # ConfAdapt's and static k's outputs depend on k: the rule off
    extra = {"mtp_mode": mode, "load_aware": mode in ("greedy", "lossless")}
    text, usage = chat(c, **extra)
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=24,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens == 24
    assert usage.model_extra["forward_passes"] >= 1


def test_completions_endpoint_streams_the_same_text(server):
    url, _ = server
    c = client(url)
    r = c.completions.create(model="tiny", prompt="the cat", max_tokens=16)
    stream = c.completions.create(model="tiny", prompt="the cat", max_tokens=16, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == r.choices[0].text
    assert r.usage.completion_tokens == 16


def test_lossless_and_greedy_agree_and_multi_token_modes_take_fewer_passes(server):
    url, _ = server
    c = client(url)
    greedy, g = chat(c, mtp_mode="greedy", max_tokens=40)
    lossless, _ = chat(c, mtp_mode="lossless", max_tokens=40)
    static, s = chat(c, mtp_mode="static", static_k=4, load_aware=False, max_tokens=40)
    assert lossless == greedy
    assert g.model_extra["forward_passes"] == 40
    assert s.model_extra["forward_passes"] == 10
    assert s.model_extra["k_max_used"] == 4


def concurrently(url, requests):
    """The chat answers to `requests` (extra-body dicts), all sent at once."""
    async def one(c, extra):
        r = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": extra.pop("text")}],
            max_tokens=extra.pop("max_tokens"), extra_body=extra)
        return r.choices[0].message.content, r.usage.model_extra["forward_passes"]

    async def all_of():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=60,
                                      max_retries=0) as c:
            return await asyncio.gather(*(one(c, dict(x)) for x in requests))

    return asyncio.run(all_of())


@pytest.mark.parametrize("mode", [{"mtp_mode": "greedy"}, {"mtp_mode": "lossless"},
                                  {"mtp_mode": "confadapt", "tau": 0.3, "load_aware": False}])
def test_eight_concurrent_requests_equal_the_same_requests_one_by_one(server, mode):
    url, _ = server
    words = ["hello", "the cat", "world", "sat", "hello the", "cat sat", "é", "日本 cat"]
    requests = [{"text": w, "max_tokens": 12 + 3 * i, **mode} for i, w in enumerate(words)]
    together = concurrently(url, requests)
    alone = [concurrently(url, [r])[0] for r in requests]
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert len({text for text, _ in together}) > 1
    if mode["mtp_mode"] == "confadapt":
        # the same passes too, and passes that kept several tokens
        assert together == alone
        assert sum(n for _, n in together) < sum(r["max_tokens"] for r in requests)


@pytest.mark.gpu
def test_a_server_on_the_suites_device_answers_as_it_streams_and_together_as_alone(folders,
                                                                                   device):
    """The GPU suite's server, on CUDA there (else on the CPU with CUDA's attention layout), with
    the load-aware rule on: its start-up timings and live pass costs run on the device."""
    argv = ["--model", folders["mtp"], "--device", device.type, "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "8", "--k-max", "4"]
    with running_server(argv) as (url, _):
        c = client(url)
        greedy, g = chat(c, mtp_mode="greedy", max_tokens=32)
        lossless, _ = chat(c, mtp_mode="lossless", max_tokens=32)
        _, s = chat(c, mtp_mode="static", static_k=4, load_aware=False, max_tokens=32)
        assert lossless == greedy and g.model_extra["forward_passes"] == 32
        assert s.model_extra["forward_passes"] == 8
        extra = {"mtp_mode": "confadapt", "tau": 0.3, "load_aware": False}
        text, _ = chat(c, **extra)
        stream = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=24,
            stream=True, extra_body=extra)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text
        words = ["hello", "the cat", "world", "sat", "é", "日本 cat"]
        requests = [{"text": w, "max_tokens": 10 + 3 * i, "mtp_mode": "lossless"}
                    for i, w in enumerate(words)]
        together = concurrently(url, requests)
        alone = [concurrently(url, [r])[0] for r in requests]
        assert [t for t, _ in together] == [t for t, _ in alone]


class FixedCosts:
    """A cost the passes do not move, C(N) = cost(N), and no exploring."""

    def __init__(self, cost):
        self.cost = cost

    def __call__(self, n, B):
        return self.cost(n)

    def observe(self, n, B, seconds):
        pass

    def explore(self, best, top, span=1, near_pays=True):
        return best


def test_the_load_aware_rule_computes_fewer_positions_when_they_do_not_pay(folders):
    """Costs in which every extra position doubles a pass's cost: the rule keeps k = 1
    (greedy's cost) whatever the measured acceptance; with free extra positions it takes the
    largest k."""
    argv = ["--model", folders["mtp"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "4", "--k-max", "4"]
    with running_server(argv) as (url, decoder):
        decoder.costs = FixedCosts(lambda n: 2.0 ** n)
        _, u = chat(client(url), mtp_mode="confadapt", tau=0.3, max_tokens=12)
        assert u.model_extra["k_max_used"] == 1, u.model_extra
        decoder.costs = FixedCosts(lambda n: 1.0)
        _, u = chat(client(url), mtp_mode="static", static_k=4, max_tokens=12)
        assert u.model_extra["k_mean"] == 4
        assert u.model_extra["forward_passes"] == 3


def decoder_with_rows(mode, n_rows, costs, pending=1, tried=(), kept=()):
    """A Decoder (no model: choose_k only reads its rows, acceptance and costs) with n_rows live
    rows of `mode`, each holding `pending` tokens to feed; the j-th prediction of the rule tried
    tried[j - 2] times and kept kept[j - 2] times."""
    decoder = serve.Decoder(None, 9, set(), n_rows, 4, costs, None)
    for _ in range(n_rows):
        r = serve.Request([1, 2], 64, mode, True, print)
        r.row = Row([1, 2], budget=64, pending=[2] * pending)
        decoder.live.append(r)
    acceptance = decoder.acceptance.setdefault(serve.rule_key(mode), Acceptance())
    for j, (t, n) in enumerate(zip(tried, kept), start=2):
        acceptance.tried[j], acceptance.kept[j] = t, n
    return decoder


def test_greedy_rows_beside_multi_token_rows_are_priced_at_one_token_a_pass():
    """15 greedy requests and one ConfAdapt request (second prediction kept 3 times in 10), a
    pass costing 100 + N. A greedy row computes one position whatever k the rule picks, so k = 4
    gains only the ConfAdapt row's 0.53 tokens for its 3.5 more positions: k = 1. Priced as if
    they too kept 4 tokens a pass, the greedy rows would make k = 4 look twice as fast."""
    decoder = decoder_with_rows(DecodeConfig("confadapt", tau=0.9, k_max=4), 1,
                                FixedCosts(lambda n: 100 + n), tried=(1000, 300, 150),
                                kept=(300, 150, 80))
    for _ in range(15):
        r = serve.Request([1, 2], 64, serve.GREEDY, True, print)
        r.row = Row([1, 2], budget=64, pending=[2])
        decoder.live.append(r)
    assert decoder.choose_k() == 1
    assert [decoder.predictions(r, 4) for r in decoder.live] == [4] + [1] * 15


def test_the_last_rows_take_the_places_of_rows_that_leave():
    """Rows 1 and 3 of 6 leave: rows 4 and 5 move into their places, so the cache copies two
    rows, not every row after the first that left."""
    decoder = decoder_with_rows(DecodeConfig("static", k=1), 6, FixedCosts(lambda n: 1.0))
    requests = list(decoder.live)
    for i in (1, 3):
        requests[i].cancelled = True
    gone = decoder.keep(lambda r: not r.cancelled)
    assert gone == [requests[1], requests[3]]
    assert decoder.live == [requests[i] for i in (0, 4, 2, 5)]


def test_the_rule_prices_lossless_at_the_share_of_passes_that_have_drafts():
    """32 lossless rows whose second prediction holds 2 times in 3, a pass costing 60 + N:
    k = 2 keeps 1.67 tokens in a pass with drafts, but only 3 passes in 4 have them (a failed
    draft leaves the next pass none), so 1.5 a pass, for 2.75 positions a row: 48 / 148 against
    k = 1's 32 / 92, so k = 1. Pricing every pass as one with drafts (53 / 145) would take k = 2.
    Where positions are cheaper (a pass costing 300 + N) k = 2 pays: 48 / 388 against 32 / 332."""
    decoder = decoder_with_rows(DecodeConfig("lossless", k=4), 32, FixedCosts(lambda n: 60 + n),
                                tried=(300, 200, 100), kept=(200, 60, 30))
    assert decoder.choose_k() == 1
    decoder.costs = FixedCosts(lambda n: 300 + n)
    assert decoder.choose_k() == 2


def test_extra_positions_must_promise_a_margin_over_greedy():
    """The rows of the test above, a pass costing 110 + N: k = 2 promises 7.5% more tokens a
    second than k = 1, inside the rule's margin, so k = 1 (greedy's own pass); at 130 + N it
    promises 11.4% more and takes k = 2."""
    decoder = decoder_with_rows(DecodeConfig("lossless", k=4), 32, FixedCosts(lambda n: 110 + n),
                                tried=(300, 200, 100), kept=(200, 60, 30))
    assert serve.MARGIN == 0.10
    assert decoder.choose_k() == 1
    decoder.costs = FixedCosts(lambda n: 130 + n)
    assert decoder.choose_k() == 2


def test_rows_between_two_timed_sizes_pay_for_their_own_positions():
    """Start-up shapes as timed on a 2-core EPYC (ms; curves for 8 and 16 rows) and ConfAdapt
    rows keeping their second prediction 3 times in 10: 8 rows take k = 1, and so do 9 to 16.
    9 rows are priced on the 16-row curve, below its first point: priced at 16 positions' cost,
    k = 1 would look dear beside k = 2 (22 positions) and 9 to 11 rows would take k = 2."""
    curves = {8: {8: 30.0, 16: 35.0, 32: 44.9, 64: 72.1},
              16: {16: 37.1, 32: 47.8, 64: 73.2, 128: 105.8}}
    picks = []
    for rows in range(8, 17):
        decoder = decoder_with_rows(DecodeConfig("confadapt", tau=0.9, k_max=4), rows,
                                    PassCosts(curves, every=10 ** 9), tried=(1000, 290, 150),
                                    kept=(290, 150, 80))
        picks.append(decoder.choose_k())
    assert picks == [1] * 9


def test_the_rule_prices_each_k_as_if_rows_had_decoded_at_it():
    """16 ConfAdapt rows that each kept 4 tokens in the last pass (k was 4 then) and keep 1.25
    a pass at k = 2, a pass costing 20 + N. At k = 1 a row feeds 1 token once its 4 are in:
    16 / 36 against k = 2's 20 / 56, so k = 1. Priced by today's pending tokens, k = 1 would
    feed 64 (16 / 84) and lose to k = 2 (20 / 100)."""
    decoder = decoder_with_rows(DecodeConfig("confadapt", tau=0.9, k_max=4), 16,
                                FixedCosts(lambda n: 20 + n), pending=4,
                                tried=(400, 100, 25), kept=(100, 25, 6))
    assert decoder.choose_k() == 1


def test_the_rule_follows_the_costs_of_the_passes_it_runs(folders, monkeypatch):
    """Start-up timings that call every pass equally cheap, and passes whose cost, on the clock
    the server reads, grows with the positions they feed (N^2 / 100 s): the rule starts at
    k = 4 and, timing its own passes, moves to k = 1. With the timings frozen it stays at 4."""
    step = serve.decode_step
    clock = [0.0]

    def timed(*args, **kwargs):
        fed = step(*args, **kwargs)
        clock[0] += 0.01 * fed ** 2
        return fed

    monkeypatch.setattr(serve, "decode_step", timed)
    monkeypatch.setattr(serve, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    argv = ["--model", folders["mtp"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "4", "--k-max", "4"]
    with running_server(argv) as (url, decoder):
        costs = PassCosts({1: {n: 1e-3 for n in (1, 2, 4, 8)}})
        decoder.costs = FixedCosts(lambda n: 1e-3)
        _, u = chat(client(url), mtp_mode="static", static_k=4, max_tokens=24)
        assert u.model_extra["k_mean"] == 4
        decoder.costs = costs
        _, first = chat(client(url), mtp_mode="static", static_k=4, max_tokens=24)
        _, later = chat(client(url), mtp_mode="static", static_k=4, max_tokens=24)
        assert first.model_extra["k_max_used"] == 4
        assert later.model_extra["k_mean"] < 1.5
        # the pass it ran most, as the clock says
        assert costs(1, 1) == pytest.approx(0.01, rel=0.05)


def test_a_busy_spell_raises_every_cost_not_only_those_of_the_passes_it_ran():
    """Passes of 4 positions cost twice those of 1; then the machine gets twice as busy while
    only 1-position passes run. The cost of 4 positions follows (about 2 x 1.0 s, not the 1.0 s
    last seen), so the rule does not take it for as cheap as 1 position now is."""
    costs = PassCosts({1: {1: 0.5, 2: 0.75, 4: 1.0, 8: 2.0}})
    for _ in range(20):
        costs.observe(1, 1, 0.5)
        costs.observe(4, 1, 1.0)
    assert costs(4, 1) / costs(1, 1) == pytest.approx(2.0, rel=0.05)
    for _ in range(20):
        costs.observe(1, 1, 1.0)
    assert costs(1, 1) == pytest.approx(1.0, rel=0.05)
    # a table of last-seen times would say 1.0 s and a ratio of 1
    assert costs(4, 1) > 1.6 and costs(4, 1) / costs(1, 1) > 1.6


def test_the_shape_learns_between_and_beyond_its_points_for_each_number_of_rows():
    """Passes of 48 positions (between the points 32 and 64) that cost what start-up said of 64
    pull the points around 48 up; passes beyond the last point extrapolate from the last two.
    The curve of 4 rows (and of 3, which shares it) does not move with those of 16 rows."""
    costs = PassCosts({16: {16: 1.0, 32: 1.5, 64: 2.5}, 4: {4: 1.0, 8: 1.5, 16: 2.0}})
    assert costs(48, 16) == pytest.approx(2.0)
    assert costs(96, 16) == pytest.approx(3.5)
    assert costs(6, 3) == pytest.approx(1.25)
    for _ in range(50):
        costs.observe(16, 16, 1.0)
        costs.observe(48, 16, 2.5)
    assert costs(48, 16) / costs(16, 16) == pytest.approx(2.5, rel=0.05)
    assert costs(6, 3) / costs(4, 4) == pytest.approx(1.25)
    # 3 rows of one position each: below the curve's first point, extrapolated from the first
    # two; what such a pass teaches goes to the first point alone
    assert costs(3, 3) == pytest.approx(costs(4, 4) - (costs(8, 4) - costs(4, 4)) / 4)
    before = {n: p[0] for n, p in costs.curves[4].items()}
    for _ in range(50):
        costs.observe(3, 3, 0.9 * costs(4, 4))
        costs.observe(4, 4, costs(4, 4))
    assert costs(3, 3) < costs(4, 4)
    assert costs.curves[4][8][0] == before[8]


def test_positions_are_priced_in_whole_tiles_of_the_matrix_kernels():
    """Where matrix kernels compute positions 16 at a time (oneDNN's AMX tiles: a 1536 x 576
    product of SmolLM2 took 269 us for 16 positions, 316 for 17 and 328 for 32 on a 2-core
    Xeon, benchmarks/pass_shapes.py), N beyond the first tile is priced rounded up to a whole
    one, and a pass teaches the points around its whole tiles; within the first, a curve of a
    few rows stays linear between its points. Without tiles, linear throughout."""
    smooth = PassCosts({16: {16: 1.0, 32: 1.5, 64: 2.5}})
    assert smooth(20, 16) == pytest.approx(1.125) and smooth(33, 16) == pytest.approx(1.53125)
    costs = PassCosts({16: {16: 1.0, 32: 1.5, 64: 2.5}, 4: {4: 0.5, 8: 0.6, 16: 0.7, 32: 1.1}},
                      tile=16)
    assert costs(16, 16) == 1.0
    assert costs(17, 16) == costs(32, 16) == 1.5
    assert costs(33, 16) == pytest.approx(2.0)
    assert costs(6, 4) == pytest.approx(0.55) and costs(12, 4) == pytest.approx(0.65)
    assert costs(17, 4) == 1.1
    for _ in range(50):
        costs.observe(16, 16, 1.0)
        costs.observe(20, 16, 2.0)
    assert costs(17, 16) == pytest.approx(2.0, rel=0.05)
    assert costs(16, 16) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("tiled", [True, False])
def test_the_tile_is_measured_on_the_models_own_matrix_products(monkeypatch, tiled):
    """Matrix products that cost a millisecond a started tile of 16 positions give a tile of 16;
    ones that grow by a tenth of a millisecond a position (AVX-512 without AMX), a tile of 1."""
    ns = types.SimpleNamespace
    layers = [ns(mlp=ns(up=ns(weight=torch.zeros(8, 4)))) for _ in range(4)]

    def linear(x, w):
        m = x.shape[0]
        time.sleep(1e-3 * -(-m // 16) if tiled else 1e-4 * m)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    assert measure_tile(ns(layers=layers), repeats=3) == (16 if tiled else 1)


def test_a_pass_that_feeds_a_joining_prompt_teaches_the_costs_nothing(folders):
    """A joining request's prompt rides in the next pass: that pass costs what the prompt does,
    so the server does not price it; every later pass of the request is priced."""
    seen = []

    class Spy(FixedCosts):
        def observe(self, n, B, seconds):
            seen.append((n, seconds))

    argv = ["--model", folders["mtp"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "4"]
    with running_server(argv) as (url, decoder):
        decoder.costs = Spy(lambda n: 1e-3)
        _, u = chat(client(url), mtp_mode="static", static_k=2, max_tokens=6, load_aware=False)
    assert len(seen) == u.model_extra["forward_passes"] == 3
    # the first pass fed the whole prompt (and a mask), the others 2 pending tokens and a mask
    assert seen[0][0] == u.prompt_tokens + 1 and seen[0][1] is None
    assert [n for n, _ in seen[1:]] == [3, 3] and all(t > 0 for _, t in seen[1:])
    costs = PassCosts({1: {1: 1.0, 2: 1.0, 4: 2.0}})
    costs.observe(4, 1, None)
    assert costs(4, 1) == 2.0 and costs.load == 1.0 and costs.passes == 1


def test_one_pass_in_every_tries_a_neighbour_of_the_rules_choice_or_greedy():
    costs = PassCosts({1: {1: 0.01, 2: 0.02, 4: 0.04}})
    picks = []
    for _ in range(4 * costs.every):
        k = costs.explore(2, top=4)
        picks.append(k)
        costs.observe(k, 1, 0.01)
    # k = 3 and k = 1 in turn, once in every `every` passes; never further than one away
    assert picks.count(3) == 2 and picks.count(1) == 2
    assert set(picks) == {1, 2, 3}
    assert {costs.explore(1, top=1) for _ in range(2 * costs.every)} == {1}
    # further from greedy: the k above, the k below and k = 1 (greedy) in turn
    picks = []
    for _ in range(3 * costs.every):
        k = costs.explore(3, top=4)
        picks.append(k)
        costs.observe(k, 1, 0.01)
    assert sorted(k for k in picks if k != 3) == [1, 2, 4]


def test_from_greedy_the_rule_tries_k_2_only_where_its_price_nearly_pays():
    """32 ConfAdapt rows that keep their second prediction 2 times in 5. Where 64 positions
    cost twice what 32 do, k = 2 promises 0.56 of greedy's tokens a second, and the rule never
    tries it: each try would cost most of a pass. Where they cost 1.2 times as much, k = 2
    promises greedy's rate, inside the margin: the rule stays at k = 1 and tries k = 2 once
    in 3 x `every` passes."""
    for curve, tries in (({32: 1.0, 64: 2.0, 128: 4.0}, 0), ({32: 1.0, 64: 1.2, 128: 2.0}, 2)):
        decoder = decoder_with_rows(DecodeConfig("confadapt", tau=0.9, k_max=4), 32,
                                    PassCosts({32: curve}), tried=(500, 200, 80),
                                    kept=(200, 80, 30))
        picks = []
        for _ in range(6 * decoder.costs.every):
            picks.append(decoder.choose_k())
            decoder.costs.observe(32, 32, None)
        assert picks.count(2) == tries and set(picks) <= {1, 2}


def test_an_explored_k_above_one_holds_for_two_passes_so_lossless_drafts_are_verified():
    """span=2 (lossless rows live): a k above 1 tried from greedy computes masks whose drafts
    only the next pass verifies, so it holds for two passes (once in 3 x `every`: from greedy
    the rule tries a third as often); k = 1 needs no drafts and is tried for one. Neither
    moves the load, which follows the rule's own passes."""
    costs = PassCosts({1: {1: 0.01, 2: 0.02, 4: 0.04}})
    picks = []
    for _ in range(9 * costs.every + 1):
        k = costs.explore(1, top=4, span=2)
        picks.append(k)
        # explored passes far slower than their shape: counted, they would move the load
        costs.observe(k, 1, 0.01 if k == 1 else 0.5)
    runs = "".join(map(str, picks)).replace("1", " ").split()
    assert runs == ["22"] * 3
    assert costs.load == pytest.approx(1.0)
    # from k = 3: k = 4 and k = 2 for two passes each, k = 1 for one
    picks = []
    for _ in range(3 * costs.every):
        k = costs.explore(3, top=4, span=2)
        picks.append(k)
        costs.observe(k, 1, 0.01)
    assert sorted(k for k in picks if k != 3) == [1, 2, 2, 4, 4]
    # span=1 (no lossless row): one pass each, as before
    assert costs.held is None
    picks = []
    for _ in range(3 * costs.every):
        picks.append(costs.explore(1, top=4))
        costs.observe(picks[-1], 1, 0.01)
    assert picks.count(2) == 1


# ---- bad input --------------------------------------------------------------------------------

BAD = [
    (b"{not json", 400, None),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content.str"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400,
     "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}, 400,
     "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}, 400,
     "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400,
     "logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": []}, 400,
     "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "mtp_mode": "fast"}, 400,
     "mtp_mode"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tau": 1.5}, 400, "tau"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "k_max": 99}, 400,
     "k_max"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "mtp_mode": "greedy",
      "tau": 0.5}, 400, "tau"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400,
     "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi " * 1100}]}, 400,
     "max_tokens"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=range(len(BAD)))
def test_bad_input_is_an_openai_error_and_the_server_goes_on(server, body, status, param):
    url, _ = server
    got, answer, _ = post(url, "/v1/chat/completions", body)
    assert got == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param
    assert answer["error"]["message"]
    # unharmed
    assert chat(client(url), max_tokens=3)[1].completion_tokens == 3


def test_a_multi_token_mode_on_a_model_without_mask_is_refused(folders):
    argv = ["--model", folders["plain"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "2"]
    with running_server(argv) as (url, _):
        with pytest.raises(openai.BadRequestError, match="mask"):
            chat(client(url), mtp_mode="confadapt")
        # its default mode is greedy
        text, usage = chat(client(url), max_tokens=5)
        assert usage.model_extra["mtp_mode"] == "greedy"


def test_api_key(folders):
    argv = ["--model", folders["mtp"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "1", "--api-key", "s3cret"]
    with running_server(argv) as (url, _):
        with pytest.raises(openai.AuthenticationError):
            chat(client(url, key="wrong"))
        status, body, _ = post(url, "/v1/chat/completions", {"model": "tiny"})
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key"
        assert chat(client(url, key="s3cret"), max_tokens=2)[1].completion_tokens == 2
        # /health stays open
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200


# ---- rows and the queue -----------------------------------------------------------------------

def wait_for(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_dropped_stream_frees_its_row_and_a_full_queue_gives_429(folders, monkeypatch):
    # passes of 10 ms or more: the long stream outlasts the test's steps by seconds
    step = serve.decode_step
    monkeypatch.setattr(serve, "decode_step", lambda *a, **k: time.sleep(0.01) or step(*a, **k))
    argv = ["--model", folders["mtp"], "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "tiny", "--max-rows", "1", "--max-queue", "1"]
    with running_server(argv) as (url, decoder):
        c = client(url)
        long = dict(model="tiny", messages=[{"role": "user", "content": "hello"}],
                    max_tokens=900, stream=True, extra_body={"mtp_mode": "greedy"})
        # the one row: a long stream
        first = c.chat.completions.create(**long)
        next(iter(first))
        assert metric(url, "mtp_live_rows") == 1
        # the queue's one place: a second request, waiting
        pool = concurrent.futures.ThreadPoolExecutor(1)
        waiting = pool.submit(chat, client(url), max_tokens=4)
        wait_for(lambda: metric(url, "mtp_queue_length") == 1)
        status, body, headers = post(url, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 429
        assert body["error"]["type"] == "rate_limit_error"
        assert headers["Retry-After"] == "1"

        # the client leaves: its row is freed, and the waiting request gets it
        first.close()
        assert waiting.result(timeout=60)[1].completion_tokens == 4
        assert metric(url, "mtp_rows_freed_by_cancel_total") == 1
        assert metric(url, "mtp_live_rows") == 0
        # far fewer than the 900 tokens it asked for were decoded
        assert metric(url, "mtp_tokens_total") < 900
        pool.shutdown()


def test_a_failing_pass_ends_its_requests_only(server, monkeypatch):
    url, decoder = server
    original = serve.decode_step
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(serve, "decode_step", fail_once)
    with pytest.raises(openai.InternalServerError, match="injected"):
        chat(client(url), max_tokens=5)
    assert chat(client(url), max_tokens=5)[1].completion_tokens == 5


# ---- a real model -----------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.isdir(SMOLLM2), reason="models/smollm2 is not present "
                    "(scripts/get_smollm2.py fetches it)")
def test_smollm2_chat_answer_equals_confadapt_greedy(tmp_path):
    prompt = "What is the capital of France?"
    common = ["--model", SMOLLM2, "--device", "cpu", "--dtype", "float32", "--threads", "2"]
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "confadapt.py"), *common,
                          "--greedy", "--format", "auto", "--prompt", prompt,
                          "--max-new-tokens", "24", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    with running_server([*common, "--served-model-name", "smol", "--max-rows", "1",
                         "--k-max", "1"]) as (url, _):
        r = client(url).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=24,
            extra_body={"mtp_mode": "greedy"})
    stop_texts = ("<|im_end|>", "<|endoftext|>")
    assert r.choices[0].message.content == expected["text"].removesuffix(
        next((s for s in stop_texts if expected["text"].endswith(s)), ""))
    assert r.usage.completion_tokens == len(expected["tokens"])


# ---- the load benchmark -----------------------------------------------------------------------

def test_serve_load_runs_load_and_shadow_and_stops_its_servers(folders, tmp_path):
    from conftest import run_script

    script = os.path.join(ROOT, "benchmarks", "serve_load.py")
    common = ["--out", str(tmp_path), "--dtype", "float32", "--threads", "1",
              "--max-tokens", "6"]
    load, shadow, bad = run_script(
        script,
        [*common, "--model", folders["mtp"], "--concurrency", "1", "2", "--rounds", "2",
         "--prompts-per-domain", "1", "--modes", "greedy", "lossless", "confadapt-off"],
        ["shadow", *common, "--a", folders["mtp"], "--b", folders["mtp"],
         "--b-mode", "lossless"],
        [*common, "--model", str(tmp_path / "missing")])
    assert load.returncode == 0, load.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    phases = {(p["concurrency"], p["decoder"]): p for p in report["phases"]}
    assert set(phases) == {(c, d) for c in (1, 2) for d in ("greedy", "lossless",
                                                            "confadapt-off")}
    # lossless answers are greedy's; every request got its 6 tokens
    assert phases[2, "lossless"]["texts"] == phases[2, "greedy"]["texts"]
    assert all(p["output_tokens"] == 6 * p["requests"] for p in phases.values())
    assert (tmp_path / "load.png").stat().st_size > 0
    # the fastest round's tokens/s; "vs greedy": at each N greedy ran before, between and after
    # the other decoders, and a decoder's tokens/s is set against the line between the greedy
    # phases just before and just after it
    table = (tmp_path / "results.md").read_text()
    # (steady: the server's own token count while every stream had a request)
    for (c, d), p in phases.items():
        assert len(p["rounds"]) == (6 if d == "greedy" else 2)
        assert p["tokens_per_second"] == max(tps for _, _, tps, _ in p["rounds"])
        assert all(steady > 0 for *_, steady in p["rounds"])
        greedy = sorted(phases[c, "greedy"]["rounds"], key=lambda x: x[1])
        ratios = {2: [], 3: []}
        for i, at, *tps in p["rounds"]:
            turns = [x for x in greedy if x[0] == i]
            if d == "greedy":
                # greedy's own row: its middle phase of each round against its first and last
                if at != turns[1][1]:
                    continue
                turns = [turns[0], turns[2]]
            else:
                # the decoder ran between the round's first and second greedy phases, or its
                # second and third, as the order turns over each round
                turns = next([a, b] for a, b in zip(turns, turns[1:]) if a[1] < at < b[1])
            (_, t0, *g0), (_, t1, *g1) = turns
            for k in ratios:
                base = g0[k - 2] + (g1[k - 2] - g0[k - 2]) * (at - t0) / (t1 - t0)
                ratios[k].append(tps[k - 2] / base)
        vs, steady = (f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
                      for r in (ratios[2], ratios[3]))
        assert (f"| {c} | {d} | {p['tokens_per_second']:.1f} | {vs} | {steady} |" in table)
        # every request on record: request i asked prompt i mod 4, and the last one read ended
        # the phase (its kind is the table's "phase ended with")
        reqs = p["per_request"]
        assert [r["prompt"] for r in reqs] == [i % 4 for i in range(len(reqs))]
        assert sum(r["tokens"] for r in reqs) == p["output_tokens"]
        last = max(reqs, key=lambda r: r["end"])
        assert 0 < last["end"] <= p["seconds"] and last["seconds"] <= last["end"]
        kind = report["meta"]["kinds"][last["prompt"]]
        assert f"| {c} | {d} | " in table.split("phase ended with")[-1]
        assert any(line.startswith(f"| {c} | {d} | ") and line.endswith(
            f"| {kind} at {last['end']:.2f} s |") for line in table.splitlines())
    assert report["meta"]["kinds"] == ["math", "code", "explain", "story"]
    assert shadow.returncode == 0, shadow.stderr
    result = json.loads((tmp_path / "shadow.json").read_text())
    assert result["identical"] == 1.0
    assert len(result["pairs"]) == 16
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --model")


def test_bad_command_lines_end_in_one_error_line(folders, capsys, tmp_path):
    bad = [(["--model", str(tmp_path / "none")], "no such folder"),
           (["--model", folders["plain"], "--mode", "confadapt"], "no <mask> token"),
           (["--model", folders["mtp"], "--max-rows", "0"], "--max-rows"),
           (["--model", folders["mtp"], "--tau", "2"], "--tau"),
           # checked against the tokenizer before any weights load
           (["--model", folders["mtp"], "--format", "llama3-chat"], "it supports"),
           (["--model", folders["mtp"], "--cudnn-attention", "never"], "--cudnn-attention")]
    for argv, says in bad:
        assert serve.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err
        assert err.count("\n") == 1
