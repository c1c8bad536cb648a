"""Serving many users at once with a multi-token decoder: an OpenAI-compatible server.

One decoding thread owns the model and its KV cache and runs passes over every live request (a
row); the HTTP handlers (mtp/openai_api.py: schemas, server-sent events, metrics, API key) only
queue requests and read back each one's tokens. Three things make it a server:

    admission        between two passes, waiting requests take the free rows, and the next
                     pass feeds their prompts beside the others' tokens (continuous batching:
                     mtp/engine.py's ragged passes); a full queue answers 429, and a client
                     that leaves frees its row before the next pass.
    one row's fault  ends that request only; the others and the server go on.
    the rule for k   how many positions each row computes in the next pass (below).

The load-aware rule. Each pass takes the k (positions a row) that serves most tokens a second:

    sum over rows of E_row(k)  /  C(N(k), B)

E_row(k): the tokens a row keeps from a pass at k (measured: how often the j-th prediction is
kept when the one before it was); N(k): the positions the pass feeds to its B rows (pending
tokens, drafts and masks); C(N, B): their cost in seconds (measured, mtp/load_rule.py). Both
are taken as if the rows had decoded at k for a while. k = 1 is greedy (E = 1), so the rule
falls back to greedy's cost when extra positions do not pay (or promise less than 10% more):
few rows leave the processor idle and extra positions are nearly free; many rows keep it busy
and every position costs (with AMX, in tiles of 16: 17 positions cost what 32 do).

    python serve.py --model DIR [--port 8000] [--api-key KEY] [--max-rows 16]

References: MTP via Self-Distillation (arXiv 2602.06019), section on deployment; Orca
(OSDI 2022) for iteration-level (continuous) batching.
"""

import queue
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from adapter import check_slots
from confadapt import DecodeConfig
from mtp.cli import chat_stop_ids, check_model_folder, load, prompt_format, run_cli
from mtp.engine import Row, decode_step, new_cache
from mtp import openai_api
from mtp.openai_api import parser
from mtp.load_rule import Acceptance, PassCosts

GREEDY = DecodeConfig("static", k=1)
# k > 1 only where it promises this much more than greedy's tokens a second: both prices are
# estimates, and a wrong k > 1 serves slower than greedy, which k = 1 never does
MARGIN = 0.10


@dataclass(eq=False)
class Request:
    """One user's request, from the handler that took it to the decoding thread and back (each
    one itself: two alike are still two)."""

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
            self.join(joining)
        except Exception as e:
            for r in joining:
                r.send("error", f"{type(e).__name__}: {e}")
            self.keep(lambda r: r.row is not None)

    def join(self, joining):
        """New, empty rows at the end of the cache, each with its whole prompt pending: the next
        pass feeds it beside the other rows' tokens and predicts from its last token. A pass of
        its own would cost about a pass of every row (on a processor), and rows that finish at
        different passes, as multi-token rows do, join one or two at a time."""
        self.live += joining
        # room for every row's prompt and budget, and one pass beyond it
        longest = max(len(r.prompt) + r.budget + 2 * r.mode.block for r in self.live)
        if self.cache is None:
            self.cache = new_cache(self.model, 0, longest)
        self.cache.grow(len(self.live), longest)
        for r in joining:
            r.row = Row(r.prompt, budget=r.budget, pending=list(r.prompt))

    def keep(self, wanted) -> list[Request]:
        """Only the live rows `wanted` keeps stay, in the cache too -> the others. The last
        rows take the places of those that leave: only they move in the cache."""
        # asked once a row: a client may cancel meanwhile
        stays = [wanted(r) for r in self.live]
        n = sum(stays)
        last = iter(i for i in range(n, len(stays)) if stays[i])
        rows = [i if stays[i] else next(last) for i in range(n)]
        gone = [r for r, s in zip(self.live, stays) if not s]
        if gone and self.cache is not None:
            self.cache.keep_rows(rows)
        self.live = [self.live[i] for i in rows]
        if not self.live:
            # an idle server holds no cache
            self.cache = None
        return gone

    def choose_k(self) -> int:
        """The load-aware rule: the k of most tokens per second (k = 1: greedy). Each k is
        priced as if every row had decoded at it for a while: a row that kept n tokens feeds
        them back in the next pass (lossless: only its own token, the drafts were fed), so
        today's leftovers of an earlier, larger k do not make a smaller k look dear."""
        top = max(r.mode.block for r in self.live)
        kept = [0.0] * (top + 1)
        fed = [0.0] * (top + 1)
        curves = {}
        for r in self.live:
            key = rule_key(r.mode)
            if key not in curves:
                curves[key] = self.curve(r.mode, top)
            e, every = curves[key]
            for k in range(1, top + 1):
                b = self.predictions(r, k)
                if r.mode.kind == "lossless":
                    # A pass has drafts only if the last one's all held, or it had none (its
                    # masks drafted anew): a share 1 / (2 - P(all held)) of passes. One
                    # without keeps 1 token; each feeds its token, drafts and b - 1 masks.
                    drafted = 1 / (2 - every[b])
                    kept[k] += drafted * e[b] + 1 - drafted
                    fed[k] += 1 + (b - 1) * (1 + drafted)
                else:
                    # what it kept comes back as pending tokens, then b - 1 masks
                    kept[k] += e[b]
                    fed[k] += e[b] + b - 1
        rates = {k: kept[k] / self.costs(fed[k], len(self.live)) for k in range(1, top + 1)}
        best = max(rates, key=rates.get)
        if rates[best] < (1 + MARGIN) * rates[1]:
            best = 1
        # a lossless row's drafts are verified a pass later: a k explored holds for two
        lossless = any(r.mode.kind == "lossless" and r.load_aware for r in self.live)
        return self.costs.explore(best, top, span=2 if lossless else 1,
                                  near_pays=rates.get(2, 0) >= (1 - MARGIN) * rates[1])

    def curve(self, mode: DecodeConfig, top: int):
        """A rule's E and P(all kept) from 0 to top predictions (static k: all kept)."""
        if mode.kind == "static":
            return list(range(top + 1)), [1.0] * (top + 1)
        return self.acceptance.setdefault(rule_key(mode), Acceptance()).curve(top)

    def predictions(self, r: Request, k: int) -> int:
        """The predictions row r makes in a pass where the rule chose k: never more than its own
        block (all of it if the rule is off for it) or the tokens it still wants."""
        wanted = r.row.budget - len(r.row.tokens)
        return min(k if r.load_aware else r.mode.block, r.mode.block, wanted)

    @torch.inference_mode()
    def step(self):
        # 1) each row's rule, limited to the k the load-aware rule chose
        k = self.choose_k()
        tried = {}
        for r in self.live:
            r.row.mode = at_most(r.mode, self.predictions(r, k))
            # lossless drafts beyond the limit are dropped (they are only guesses)
            r.row.drafts = r.row.drafts[: r.row.mode.block - 1]
            # the predictions this pass can keep: lossless, the drafts it verifies and one
            tried[id(r)] = len(r.row.drafts) + 1 if r.mode.kind == "lossless" else r.row.mode.block

        # 2) one ragged pass of every live row (one feeding a joining prompt is not priced)
        rows = [r.row for r in self.live]
        joins = any(not row.chunk_sizes for row in rows)
        start = time.perf_counter()
        fed = decode_step(self.model, self.cache, rows, GREEDY, mask_id=self.mask_id,
                          pad_id=0, stop_ids=self.stop_ids)
        self.costs.observe(fed, len(rows), None if joins else time.perf_counter() - start)
        self.metrics.pass_done(len(rows), sum(row.chunk_sizes[-1] for row in rows))

        # 3) every request gets its new tokens; finished rows leave
        for r in self.live:
            m = r.row.mode
            kept = r.row.chunk_sizes[-1]
            if m.kind != "static" and tried[id(r)] > 1:
                self.acceptance.setdefault(rule_key(m), Acceptance()).observe(tried[id(r)], kept)
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
    costs = PassCosts.timed(model, k_top, args.max_rows)
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
