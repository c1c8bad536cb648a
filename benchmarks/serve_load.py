"""Benchmark: serve.py under load, with the real (async) openai client; and a shadow comparison.

load (the default): starts serve.py on a free 127.0.0.1 port, sends the decoding benchmark's
chat prompts (benchmarks/decode_real.py's four kinds) as N concurrent streams (1, 4, 16, 32),
each decoder in turn at each N on the same server, and reports output tokens/s, requests/s, time
to first token (TTFT) and time per output token after the first (TPOT) at p50/p95, and tokens per
forward pass of a row (from `usage`). The client and the server share the machine: its threads
are named in results.json. Writes results.json, results.md and load.png to --out.

    python benchmarks/serve_load.py --model DIR --out DIR [--threads 2] [--dtype bfloat16]

shadow: the rollout step. Replays a JSONL of chat requests (prompts/shadow_chat.jsonl) against
two endpoints, one request at a time, alternating A, B, A, B, ...: the share of identical answers,
where the first difference falls, and the latency ratio B / A. An endpoint is a URL of a running
server or a model folder (then served here on a free port), each with its own mtp_mode.

    python benchmarks/serve_load.py shadow --a DIR_OR_URL --a-mode greedy \\
        --b DIR_OR_URL --b-mode confadapt --prompts prompts/shadow_chat.jsonl --out DIR

Every server this script starts listens on 127.0.0.1 and is stopped when it ends.
"""
import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode_real import chat_prompts  # noqa: E402
from mtp.cli import CliError, Parser, cpu_name, positive_int, read_rows, run_cli  # noqa: E402
from mtp.hf import write_text  # noqa: E402

# decoder name -> the request's extra body fields ({tau} and {k} filled from the flags)
DECODERS = {
    "greedy": {"mtp_mode": "greedy"},
    "confadapt": {"mtp_mode": "confadapt", "tau": "{tau}", "k_max": "{k}"},
    "confadapt-off": {"mtp_mode": "confadapt", "tau": "{tau}", "k_max": "{k}",
                      "load_aware": False},
    "lossless": {"mtp_mode": "lossless", "k_max": "{k}"},
    "lossless-off": {"mtp_mode": "lossless", "k_max": "{k}", "load_aware": False},
    "static": {"mtp_mode": "static", "static_k": "{k}"},
    "static-off": {"mtp_mode": "static", "static_k": "{k}", "load_aware": False},
}


def extra_body(name, tau, k) -> dict:
    fill = {"{tau}": tau, "{k}": k}
    return {key: fill.get(v, v) if isinstance(v, str) else v
            for key, v in DECODERS[name].items()}


# --- a server of our own ---

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model, flags, log):
    """serve.py on `model` on a free loopback port for the with-block -> its URL."""
    port = free_port()
    command = [sys.executable, str(ROOT / "serve.py"), "--model", model, "--host", "127.0.0.1",
               "--port", str(port), *flags]
    print("starting:", " ".join(command[1:]), file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise CliError(f"serve.py ended with status {proc.returncode} (see its log)")
            if time.monotonic() > deadline:
                raise CliError("serve.py did not answer /health within 10 minutes")
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def model_name(url) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


# --- one stream, one phase ---

async def stream(client, model, messages, max_tokens, extra) -> dict:
    """One streamed chat request -> its text, TTFT, TPOT, tokens and forward passes."""
    start = time.perf_counter()
    first = last = None
    text = []
    usage = None
    chunks = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in chunks:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            text.append(chunk.choices[0].delta.content)
    end = time.perf_counter()
    n = usage.completion_tokens
    first = first or end
    return {"text": "".join(text), "tokens": n, "passes": usage.model_extra["forward_passes"],
            "k_mean": usage.model_extra["k_mean"], "seconds": end - start,
            "ttft": first - start, "tpot": ((last or end) - first) / max(1, n - 1)}


async def phase(url, model, prompts, concurrency, n_requests, max_tokens, extra) -> dict:
    """n_requests streams, `concurrency` at a time -> the phase's figures. Its steady part ends
    when a stream first finds no request left: from then on fewer than `concurrency` run, and
    the phase ends with its slowest stream."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    started = 0
    steady = {}
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get(
            "OPENAI_API_KEY", "none"), timeout=600, max_retries=0) as client:
        async def one(i):
            nonlocal started
            async with gate:
                started += 1
                messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
                r = await stream(client, model, messages, max_tokens, extra)
                r["prompt"], r["end"] = i % len(prompts), time.perf_counter() - start
            if started == n_requests and not steady:
                steady["end"] = time.perf_counter()
                steady["tokens"] = await asyncio.to_thread(tokens_decoded, url)
            return r

        before = await asyncio.to_thread(tokens_decoded, url)
        start = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(n_requests)))
        seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in done)
    return {"concurrency": concurrency, "requests": n_requests, "seconds": seconds,
            "output_tokens": tokens, "tokens_per_second": tokens / seconds,
            # the server's tokens while every stream had a request (its own count: /metrics)
            "steady_tokens_per_second": (steady["tokens"] - before) / (steady["end"] - start),
            "requests_per_second": n_requests / seconds,
            "ttft_p50": pct([r["ttft"] for r in done], 50),
            "ttft_p95": pct([r["ttft"] for r in done], 95),
            "tpot_p50": pct([r["tpot"] for r in done], 50),
            "tpot_p95": pct([r["tpot"] for r in done], 95),
            "tokens_per_pass": tokens / max(1, sum(r["passes"] for r in done)),
            "k_mean": statistics.mean(r["k_mean"] for r in done),
            "texts": [r["text"] for r in done],
            # each request: its prompt, when it ended (s after the phase began), its seconds,
            # tokens and passes (which requests the phase waited for last)
            "per_request": [{k: r[k] for k in ("prompt", "end", "seconds", "tokens", "passes")}
                            for r in done]}


def tokens_decoded(url) -> float:
    """The server's count of the tokens it has decoded (/metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("mtp_tokens_total "):
                return float(line.split()[1])
    raise CliError(f"{url}/metrics has no mtp_tokens_total")


def pct(xs, q) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


# --- load ---

def load_run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = chat_prompts(args.prompts_per_domain)
    kinds, prompts = [kind for kind, _ in pairs], [text for _, text in pairs]
    flags = ["--dtype", args.dtype, "--max-rows", str(max(args.concurrency)),
             "--max-queue", str(4 * max(args.concurrency)), "--k-max", str(args.k_max),
             "--served-model-name", "model"]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.device:
        flags += ["--device", args.device]
    report = {"meta": {"model": args.model, "server_flags": flags, "cpu": cpu_name(),
                       "server_threads": args.threads, "client": "one process, asyncio, "
                       "openai.AsyncOpenAI, on the same machine",
                       "prompts": prompts, "kinds": kinds,
                       "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "commit": commit()},
              "phases": []}
    with open(out / "server.log", "w") as log, served(args.model, flags, log) as url:
        # untimed: every decoder once, so first-call costs and acceptance start-up are not timed
        for name in args.modes:
            extra = extra_body(name, args.tau, args.k_max)
            asyncio.run(phase(url, "model", prompts, 4, 4, args.max_tokens, extra))
        # the decoders take turns at each N, `rounds` times, in the opposite order every other
        # round, each between two greedy phases (turn_order); each phase keeps its fastest round
        # (a busy moment of the machine then slows one round, not one decoder)
        best = {}
        began = time.monotonic()
        for i in range(args.rounds):
            for c in args.concurrency:
                for name in turn_order(args.modes, i):
                    extra = extra_body(name, args.tau, args.k_max)
                    n = max(len(prompts), args.requests_per_stream * c)
                    start = time.monotonic() - began
                    r = asyncio.run(phase(url, "model", prompts, c, n, args.max_tokens, extra))
                    r["decoder"] = name
                    print(f"{c:>3} streams  {name:<14} {r['tokens_per_second']:7.1f} tokens/s  "
                          f"TTFT p50 {r['ttft_p50']:.2f} s  TPOT p50 {r['tpot_p50'] * 1e3:.0f} "
                          f"ms  {r['tokens_per_pass']:.2f} tokens/pass  k {r['k_mean']:.2f}",
                          file=sys.stderr, flush=True)
                    # every phase run: its round, its middle moment (s), its tokens/s and its
                    # steady part's
                    r["rounds"] = best.get((c, name), {}).get("rounds", []) + [
                        [i, start + r["seconds"] / 2, r["tokens_per_second"],
                         r["steady_tokens_per_second"]]]
                    if r["tokens_per_second"] >= max(x[2] for x in r["rounds"]):
                        best[c, name] = r
                    best[c, name]["rounds"] = r["rounds"]
                    report["phases"] = list(best.values())
                    save_load(report, out)
    return report


def turn_order(modes, i) -> list[str]:
    """Round i's turns at one N: the decoders in order (reversed in odd rounds), and with
    greedy among them, greedy before, between and after them, so that every other decoder ran
    between two greedy phases a few seconds to a minute apart."""
    others = [m for m in modes if m != "greedy"]
    others = others[::-1] if i % 2 else others
    if "greedy" not in modes:
        return others
    return ["greedy", *(m for o in others for m in (o, "greedy"))]


def commit():
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return git.stdout.strip() or None


def save_load(report, out: Path):
    write_text(out / "results.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "results.md", load_markdown(report))
    plot(report, out / "load.png")


def load_markdown(report) -> str:
    m = report["meta"]
    greedy = {p["concurrency"]: p["rounds"] for p in report["phases"] if p["decoder"] == "greedy"}
    lines = [f"### serve.py under load: {m['model']} on {m['cpu']}", "",
             f"Server: `serve.py {' '.join(m['server_flags'])}`; client: {m['client']}; "
             f"{len(m['prompts'])} prompts, max_tokens {m['max_tokens']}; "
             f"the fastest of {m['rounds']} round(s) of turns.", "",
             "| streams | decoder | tokens/s | vs greedy | steady: vs greedy | requests/s "
             "| TTFT p50 / p95 (s) | TPOT p50 / p95 (ms) | tokens/pass | mean k |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in report["phases"]:
        base = greedy.get(p["concurrency"])
        vs = steady = ""
        if base and p["decoder"] == "greedy":
            vs, steady = (spread(control(base, steady=col == 3)) for col in (2, 3))
        elif base:
            vs, steady = (spread(paired_ratios(p["rounds"], base, steady=col == 3))
                          for col in (2, 3))
        lines.append(f"| {p['concurrency']} | {p['decoder']} | {p['tokens_per_second']:.1f} "
                     f"| {vs} | {steady} | {p['requests_per_second']:.2f} "
                     f"| {p['ttft_p50']:.2f} / {p['ttft_p95']:.2f} "
                     f"| {p['tpot_p50'] * 1e3:.0f} / {p['tpot_p95'] * 1e3:.0f} "
                     f"| {p['tokens_per_pass']:.2f} | {p['k_mean']:.2f} |")
    lines += ["", "tokens/s: output tokens over the phase's wall time (first request sent to "
              "last answer read), the fastest round; vs greedy: the median over rounds of its "
              "tokens/s over greedy's at the same moment (greedy ran just before and just after "
              "it; between them, a straight line), with its range over rounds; greedy's own "
              "row: each greedy phase between two others of its round set against the line "
              "between them in the same way, what a decoder doing greedy's work would read (the "
              "benchmark's resolution); steady: the same for the tokens the "
              "server decoded until a stream first found no request left (every stream busy); "
              "TPOT: seconds per output token after the first; "
              "tokens/pass: output tokens per forward pass of a row; mean k: positions a row "
              "computed per pass (the load-aware rule's choice; -off: the rule off).", ""]
    return "\n".join(lines + request_lines(report))


def request_lines(report) -> list[str]:
    """Seconds a request took, by kind of prompt, in each phase's fastest round, and the kind of
    the request the phase ended with: a phase lasts until its last request ends."""
    kinds = report["meta"]["kinds"]
    names = list(dict.fromkeys(kinds))
    lines = ["| streams | decoder | " + " | ".join(names) + " | phase ended with |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for p in report["phases"]:
        took = {n: [r["seconds"] for r in p["per_request"] if kinds[r["prompt"]] == n]
                for n in names}
        last = max(p["per_request"], key=lambda r: r["end"])
        lines.append(f"| {p['concurrency']} | {p['decoder']} | "
                     + " | ".join(f"{statistics.median(t):.2f}" if t else "" for t in
                                  took.values())
                     + f" | {kinds[last['prompt']]} at {last['end']:.2f} s |")
    return ["Seconds a request took (median by kind of prompt) in the round kept above (the "
            "fastest), and the request the phase ended with:", ""] + lines + [""]


def paired_ratios(rounds, base_rounds, steady=False) -> list[float]:
    """A decoder's tokens/s over greedy's at the same moment, each round: greedy ran just before
    and just after it (turn_order), and its tokens/s at the phase's middle moment is read off the
    line between those two greedy phases, so a machine whose speed drifts moves both alike.
    Rounds are [round, moment, tokens/s, steady part's tokens/s]; steady: the steady parts'."""
    k = 3 if steady else 2
    return [x[k] / greedy_at([(y[1], y[k]) for y in base_rounds if y[0] == x[0]], x[1])
            for x in rounds]


def greedy_at(points, t) -> float:
    """Greedy's tokens/s at moment t: the line between its last phase before t and its first
    after (points: [(moment, tokens/s)])."""
    before = max((p for p in points if p[0] < t), default=None)
    after = min((p for p in points if p[0] > t), default=None)
    (t0, g0), (t1, g1) = before or after, after or before
    return g0 + (g1 - g0) * (t - t0) / (t1 - t0) if t1 > t0 else g0


def control(base_rounds, steady=False) -> list[float]:
    """Greedy measured as the decoders are: each greedy phase between two others of its round,
    over the line between them (two turns apart, so a little wider than a decoder's). What a
    decoder that does greedy's own work reads: the benchmark's resolution on this machine."""
    k = 3 if steady else 2
    ratios = []
    for x in base_rounds:
        others = [(y[1], y[k]) for y in base_rounds if y[0] == x[0] and y[1] != x[1]]
        if any(t < x[1] for t, _ in others) and any(t > x[1] for t, _ in others):
            ratios.append(x[k] / greedy_at(others, x[1]))
    return ratios


def spread(ratios) -> str:
    """The median and the range of a decoder's ratios over rounds."""
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def plot(report, path):
    """Output tokens/s against concurrent streams, a line per decoder."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    for name in dict.fromkeys(p["decoder"] for p in report["phases"]):
        pts = [(p["concurrency"], p["tokens_per_second"]) for p in report["phases"]
               if p["decoder"] == name]
        style = "--" if name.endswith("-off") else "-"
        ax.plot(*zip(*pts), marker="o", linestyle=style, label=name)
    streams = sorted({p["concurrency"] for p in report["phases"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(s) for s in streams])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"serve.py, {Path(report['meta']['model']).name}: "
                 f"{report['meta']['cpu']}", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# --- shadow ---

def shadow_run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(args.prompts)
    for i, row in enumerate(rows, 1):
        if not isinstance(row.get("messages"), list):
            raise CliError(f"{args.prompts} row {i}: expected a 'messages' list")
    flags = ["--dtype", args.dtype, "--max-rows", "1", "--served-model-name", "model",
             "--k-max", str(args.k_max)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.device:
        flags += ["--device", args.device]
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(out / "shadow_servers.log", "w"))
        urls = [u if u.startswith("http") else stack.enter_context(served(u, flags, log))
                for u in (args.a, args.b)]
        sides = [(url, model_name(url), extra_body(mode, args.tau, args.k_max))
                 for url, mode in zip(urls, (args.a_mode, args.b_mode))]
        pairs = asyncio.run(replay(sides, rows, args.max_tokens))
    same = [a["text"] == b["text"] for a, b in pairs]
    differ = [first_difference(a["text"], b["text"]) for a, b in pairs]
    modes = [json.dumps(extra_body(m, args.tau, args.k_max)) for m in (args.a_mode, args.b_mode)]
    report = {"meta": {"a": args.a, "a_mode": modes[0], "b": args.b, "b_mode": modes[1],
                       "prompts": shown(args.prompts), "max_tokens": args.max_tokens,
                       "cpu": cpu_name(), "threads": args.threads, "commit": commit()},
              "identical": sum(same) / len(same),
              "first_difference_chars": [d for d in differ if d is not None],
              "latency_ratio_b_over_a": sum(b["seconds"] for _, b in pairs)
              / sum(a["seconds"] for a, _ in pairs),
              "pairs": [{"a": a, "b": b} for a, b in pairs]}
    write_text(out / "shadow.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "shadow.md", shadow_markdown(report))
    return report


async def replay(sides, rows, max_tokens):
    """Each request to A then to B, one at a time -> [(A's answer, B's answer)]."""
    import openai

    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600,
                                  max_retries=0) for url, _, _ in sides]
    pairs = []
    for row in rows:
        n = row.get("max_tokens", max_tokens)
        answers = [await stream(c, model, row["messages"], n, extra)
                   for c, (_, model, extra) in zip(clients, sides)]
        pairs.append(tuple(answers))
    for c in clients:
        await c.close()
    return pairs


def shown(path) -> str:
    """A path inside the repository, relative to it (as the results name it)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def first_difference(a: str, b: str):
    """The first character where the two answers differ (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shadow_markdown(r) -> str:
    m = r["meta"]
    d = sorted(r["first_difference_chars"])
    where = (f"median character {statistics.median(d):.0f} (range {d[0]}-{d[-1]})"
             if d else "none")
    n = len(r["pairs"])
    return "\n".join([
        f"### Shadow comparison: A = {m['a']} ({m['a_mode']}), B = {m['b']} ({m['b_mode']})", "",
        f"{n} chat requests from {m['prompts']}, max_tokens {m['max_tokens']}, one at a time "
        f"alternating A, B on {m['cpu']} ({m['threads']} threads).", "",
        "| identical answers | first difference | latency B / A |", "|---|---|---|",
        f"| {r['identical']:.0%} ({round(r['identical'] * n)}/{n}) | {where} "
        f"| {r['latency_ratio_b_over_a']:.2f} |", ""])


# --- command line ---

def parser() -> Parser:
    p = Parser(prog="serve_load.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="load", choices=["load", "shadow"])
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=positive_int, default=None,
                   help="each server's CPU threads (default: torch's choice)")
    p.add_argument("--device", default=None, help="each server's --device (default: serve.py's)")
    p.add_argument("--max-tokens", type=positive_int, default=100)
    g = p.add_argument_group("load")
    g.add_argument("--model", help="the model folder to serve")
    g.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 4, 16, 32])
    g.add_argument("--modes", nargs="+", choices=list(DECODERS),
                   default=["greedy", "confadapt", "confadapt-off", "lossless", "lossless-off"])
    g.add_argument("--tau", type=float, default=0.9)
    g.add_argument("--k-max", type=positive_int, default=4)
    g.add_argument("--prompts-per-domain", type=positive_int, default=2,
                   help="decode_real.py's prompts: this many of each of its four kinds")
    g.add_argument("--rounds", type=positive_int, default=1,
                   help="the decoders take turns this many times; each phase keeps its fastest")
    g.add_argument("--requests-per-stream", type=positive_int, default=2,
                   help="N streams send max(prompts, this x N) requests")
    s = p.add_argument_group("shadow")
    for side in ("a", "b"):
        s.add_argument(f"--{side}", help=f"endpoint {side.upper()}: a URL or a model folder")
        s.add_argument(f"--{side}-mode", default="greedy", choices=list(DECODERS),
                       help="its decoder (with --tau, --k-max)")
    s.add_argument("--prompts", default=str(ROOT / "prompts" / "shadow_chat.jsonl"))
    return p


def main_body(argv):
    args = parser().parse_args(argv)
    if args.command == "load":
        if not args.model or not os.path.isdir(args.model):
            raise CliError(f"--model {args.model}: no such folder")
        print(load_markdown(load_run(args)))
    else:
        if not args.a or not args.b:
            raise CliError("shadow needs --a and --b (a URL or a model folder each)")
        print(shadow_markdown(shadow_run(args)))


def main(argv=None) -> int:
    return run_cli(main_body, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
