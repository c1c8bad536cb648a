"""Serving many users at once with a multi-token decoder: an OpenAI-compatible server.

One decoding thread owns the model and its KV cache and runs passes over every live request (a
row); the HTTP handlers (mtp/openai_api.py: schemas, server-sent events, metrics, API key) only
queue requests and read back each one's tokens. Three things make it a server:

    admission        between two passes, waiting requests take the free rows (continuous
                     batching: mtp/engine.py's ragged passes); a full queue answers 429, and a
                     client that leaves frees its row before the next pass.
    one row's fault  ends that request only; the others and the server go on.
    the rule for k   how many positions each row computes in the next pass (below).

The load-aware rule. A pass of k positions a row keeps E(k) tokens per row on average
(measured: how often the j-th prediction is kept, given the one before it was), and costs
C(k, B) seconds at B live rows. Each pass takes the k that maximises

    sum over rows of E_row(k)  /  C(k, B)

that is, tokens served per second. k = 1 is greedy (E = 1), so the rule falls back to greedy's
cost when extra positions do not pay: few rows leave the processor idle and extra positions
are nearly free; many rows keep it busy and every position costs. C starts from passes timed
at start-up on an idle server, then follows the passes the server runs: under load (the HTTP
side, the clients, other rows) costs move, and start-up ratios underprice extra positions.

    python serve.py --model DIR [--port 8000] [--api-key KEY] [--max-rows 16]

References: MTP via Self-Distillation (arXiv 2602.06019), section on deployment; Orca
(OSDI 2022) for iteration-level (continuous) batching.
"""

import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from adapter import check_slots
from confadapt import DecodeConfig
from mtp.cli import chat_stop_ids, check_model_folder, load, prompt_format, run_cli
from mtp.engine import Row, decode_step, new_cache, prefill, time_passes
from mtp import openai_api
from mtp.openai_api import parser

GREEDY = DecodeConfig("static", k=1)


@dataclass
class Request:
    """One user's request, from the handler that took it to the decoding thread and back."""

    prompt: list[int]
    # most new tokens
    budget: int
    mode: DecodeConfig
    # False: every pass computes the mode's own k (for outputs that depend on k)
    load_aware: bool
    # the handler reads ("tokens", ids), then ("done", info) or ("error", text)
    send: callable
    # set by the handler (client gone, stop string seen): the row is freed
    cancelled: bool = False
    row: Row | None = None
    # positions computed per row in each of its passes
    ks: list[int] = field(default_factory=list)


class Acceptance:
    """E(k) for one rule: the tokens a row keeps from a pass of k positions. From every pass:
    how often the j-th prediction is kept when the (j-1)-th was (starting from 1 in 2)."""

    def __init__(self):
        self.tried = Counter()
        self.kept = Counter()

    def observe(self, k: int, n: int):
        # the j-th of k predictions was tried if the first j-1 were kept
        for j in range(2, k + 1):
            if n >= j - 1:
                self.tried[j] += 1
                self.kept[j] += n >= j

    def expected(self, k: int) -> float:
        e = p = 1.0
        for j in range(2, k + 1):
            p *= (self.kept[j] + 1) / (self.tried[j] + 2)
            e += p
        return e


class PassCosts:
    """C(k, B): seconds of a pass of k positions a row at B live rows. Timed at start-up for
    every k at B = 1, 2, 4, ... max_rows (a B in between shares the next larger one's cell),
    then the passes the server runs take over: a cell's first pass replaces its start-up time,
    and every later one moves it a fifth of the way to its own. So that a cell the rule has
    stopped choosing still follows the load, one pass in `every` computes the k next to the
    rule's choice that was timed longest ago."""

    def __init__(self, model, k_top: int, max_rows: int, every=32):
        self.sizes = sorted({min(2 ** i, max_rows) for i in range(max_rows.bit_length() + 1)})
        self.seconds = time_passes(model, range(1, k_top + 1), self.sizes)
        self.every = every
        self.passes = 0
        # the pass count at which each cell was last timed
        self.timed = {}

    def __call__(self, k: int, B: int) -> float:
        return self.seconds[k, self.cell(B)]

    def cell(self, B: int) -> int:
        return min(s for s in self.sizes if s >= B)

    def observe(self, k: int, B: int, seconds: float):
        """A pass the server ran: k positions a row, B rows, `seconds`."""
        key = k, self.cell(B)
        weight = 1 / 5 if key in self.timed else 1
        self.seconds[key] += (seconds - self.seconds[key]) * weight
        self.passes += 1
        self.timed[key] = self.passes

    def explore(self, best: int, B: int, top: int) -> int:
        """The k to compute in this pass: mostly `best`, the rule's choice."""
        if self.passes % self.every:
            return best
        near = [k for k in (best - 1, best + 1) if 1 <= k <= top] or [best]
        return min(near, key=lambda k: self.timed.get((k, self.cell(B)), -1))


class Decoder:
    """The decoding thread: it owns the model and the KV cache, admits requests between
    passes, runs one pass of every live row and sends each request its new tokens."""

    def __init__(self, model, mask_id, stop_ids, max_rows, max_queue, costs, metrics):
        self.model = model
        self.mask_id = mask_id
        self.stop_ids = stop_ids
        self.max_rows = max_rows
        self.costs = costs
        self.metrics = metrics
        self.waiting = queue.Queue(max_queue)
        self.live = []
        self.cache = None
        self.acceptance = {}
        self.running = True
        self.thread = threading.Thread(target=self.run, name="decoder", daemon=True)

    def submit(self, prompt, budget, mode, load_aware, send) -> Request:
        """Queue a request; queue.Full when the queue is full (HTTP: 429)."""
        request = Request(prompt, budget, mode, load_aware, send)
        self.waiting.put_nowait(request)
        return request

    def run(self):
        """The decoding loop: admit, free the rows of clients gone, one pass."""
        while self.running:
            self.admit()
            gone = self.keep(lambda r: not r.cancelled)
            self.metrics.cancelled += len(gone)
            if not self.live:
                continue
            try:
                self.step()
            except Exception as e:
                # the pass failed for every row in it: those requests end, the server goes on
                for r in self.live:
                    r.send("error", f"{type(e).__name__}: {e}")
                self.live = []
                self.cache = None

    def admit(self):
        """Waiting requests take the free rows; with no live row, wait for one."""
        joining = []
        while len(self.live) + len(joining) < self.max_rows:
            idle = not self.live and not joining
            try:
                r = self.waiting.get(block=idle, timeout=0.1 if idle else None)
            except queue.Empty:
                break
            if not r.cancelled:
                joining.append(r)
        if not joining:
            return
        try:
            self.prefill(joining)
        except Exception as e:
            for r in joining:
                r.send("error", f"{type(e).__name__}: {e}")
            self.keep(lambda r: r.row is not None)

    def prefill(self, joining):
        """New rows at the end of the cache, each holding its prompt but the last token."""
        first = len(self.live)
        self.live += joining
        # room for every row's prompt and budget, and one pass beyond it
        longest = max(len(r.prompt) + r.budget + 2 * r.mode.block for r in self.live)
        if self.cache is None:
            self.cache = new_cache(self.model, 0, longest)
        self.cache.grow(len(self.live), longest)
        prompts = {first + i: r.prompt for i, r in enumerate(joining)}
        prefill(self.model, self.cache, prompts, pad_id=0)
        for r in joining:
            r.row = Row(r.prompt, budget=r.budget, pending=[r.prompt[-1]])

    def keep(self, wanted) -> list[Request]:
        """Only the live rows `wanted` keeps stay, in the cache too -> the others."""
        rows = [i for i, r in enumerate(self.live) if wanted(r)]
        gone = [r for r in self.live if not wanted(r)]
        if gone and self.cache is not None:
            self.cache.keep_rows(rows)
        self.live = [self.live[i] for i in rows]
        if not self.live:
            # an idle server holds no cache
            self.cache = None
        return gone

    def choose_k(self) -> int:
        """The load-aware rule: the k of most tokens per second (k = 1: greedy)."""
        B = len(self.live)
        fixed = max([r.mode.block for r in self.live if not r.load_aware], default=1)
        top = max(r.mode.block for r in self.live)
        rates = {}
        for k in range(1, top + 1):
            kept = sum(self.expected(r, k) for r in self.live)
            rates[k] = kept / self.costs(max(k, fixed), B)
        return self.costs.explore(max(rates, key=rates.get), B, top)

    def expected(self, r: Request, k: int) -> float:
        m = at_most(r.mode, k if r.load_aware else r.mode.block)
        if m.kind == "static":
            return m.k
        return self.acceptance.setdefault(rule_key(m), Acceptance()).expected(m.block)

    @torch.inference_mode()
    def step(self):
        # 1) each row's rule, limited to the k the load-aware rule chose
        k = self.choose_k()
        for r in self.live:
            r.row.mode = at_most(r.mode, k if r.load_aware else r.mode.block)
            # lossless drafts beyond the limit are dropped (they are only guesses)
            r.row.drafts = r.row.drafts[: r.row.mode.block - 1]

        # 2) one ragged pass of every live row
        rows = [r.row for r in self.live]
        start = time.perf_counter()
        decode_step(self.model, self.cache, rows, GREEDY, mask_id=self.mask_id, pad_id=0,
                    stop_ids=self.stop_ids)
        # the pass's cost, at the most positions a row computed
        widest = max(row.mode.block for row in rows)
        self.costs.observe(widest, len(rows), time.perf_counter() - start)
        self.metrics.pass_done(len(rows), sum(row.chunk_sizes[-1] for row in rows))

        # 3) every request gets its new tokens; finished rows leave
        for r in self.live:
            m = r.row.mode
            kept = r.row.chunk_sizes[-1]
            if m.block > 1:
                self.acceptance.setdefault(rule_key(m), Acceptance()).observe(m.block, kept)
            r.ks.append(m.block)
            r.send("tokens", r.row.tokens[-kept:])
            if r.row.done:
                r.send("done", {"passes": len(r.ks), "ks": r.ks})
        self.keep(lambda r: not r.row.done)


def at_most(mode: DecodeConfig, k: int) -> DecodeConfig:
    """The mode computing at most k positions a row."""
    if mode.kind == "confadapt":
        return replace(mode, k_max=min(mode.k_max, k))
    return replace(mode, k=min(mode.k, k))


def rule_key(mode: DecodeConfig):
    """Acceptance is measured per rule (and threshold), whatever k."""
    return mode.kind, mode.tau if mode.kind == "confadapt" else None


# --- the command line (its flags: mtp/openai_api.py) ---

def build(args):
    """The model, its decoder (not started) and the web app over it -> (app, decoder)."""
    # before any weights: the adapter's base, the format, the folder's own k_max and format
    check_model_folder(args)
    model, tokenizer, mask_id, stop_ids = load(args, GREEDY)
    fmt = prompt_format(args.format, tokenizer, model)
    stop_ids = chat_stop_ids(stop_ids, tokenizer, fmt)
    mode = args.mode or ("confadapt" if mask_id is not None else "greedy")
    # both are positive when given: `or` only fills in the defaults
    args.tau = args.tau or 0.9
    args.k_max = args.k_max or 16
    defaults = openai_api.decode_config(mode, args.tau, args.k_max, args.static_k)
    if defaults.block > 1 and mask_id is None:
        raise ValueError(f"--mode {mode}: model {args.model} has no <mask> token; "
                         "only greedy works")

    print("timing passes for the load-aware rule ...", file=sys.stderr, flush=True)
    # the most positions a row may compute: the cost table's range, a request's limit
    k_top = 1 if mask_id is None else max(args.k_max, args.static_k)
    check_slots(model, k_top)
    costs = PassCosts(model, k_top, args.max_rows)
    decoder = Decoder(model, mask_id, stop_ids, args.max_rows, args.max_queue, costs,
                      openai_api.Metrics())
    app = openai_api.build_app(decoder, tokenizer, model, fmt, args, defaults, k_top)
    return app, decoder


def serve_main(argv):
    import uvicorn

    args = parser().parse_args(argv)
    app, decoder = build(args)
    decoder.thread.start()
    print(f"serving {args.served_model_name or args.model} on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    decoder.running = False


def main(argv=None) -> int:
    return run_cli(serve_main, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
