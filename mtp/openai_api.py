"""The OpenAI-compatible HTTP layer of serve.py; support code a learner can skip.

What a client of OpenAI's API expects, over serve.py's decoding thread: the request schemas
(pydantic, strict: a wrong type or an unknown field is a 400), OpenAI's error body, server-sent
events in OpenAI's chunk format, `usage`, the API key, /health and /metrics (Prometheus text),
and the text of a stream made from token ids as they come (`TextStream`). The server decodes by
argmax: an absent `temperature` means argmax, and a parameter it cannot honour (temperature > 0,
top_p < 1, n > 1, logprobs, penalties) is refused with a 400, never ignored.

Extra body fields choose the decoding per request: mtp_mode (greedy, lossless, confadapt,
static), tau, k_max, static_k, and load_aware (false: every pass computes the mode's own k).
"""

import argparse
import asyncio
import codecs
import contextlib
import json
import queue
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from confadapt import DecodeConfig
from mtp.cli import (Parser, add_flags, add_model_args, encode_prompt, positive_int,
                     probability)
from mtp.tokenizer import prompt_tokens

MODES = ("greedy", "lossless", "confadapt", "static")
# max_tokens when a request gives none (capped by what the context leaves)
DEFAULT_MAX_TOKENS = 256


# --- serve.py's command line ---

def parser() -> Parser:
    p = Parser(prog="serve.py", description="An OpenAI-compatible server over the "
               "continuous-batching multi-token decoder.")
    add_model_args(p)
    s = p.add_argument_group("serving")
    add_flags(s,
              ("--host", None, "127.0.0.1", "address to listen on"),
              ("--port", positive_int, 8000, "port to listen on"),
              ("--served-model-name", None, None, "the model's name in the API "
               "(default: the --model argument)"),
              ("--api-key", None, None, "every /v1 request must carry "
               "'Authorization: Bearer KEY' (default: none needed)"),
              ("--max-rows", positive_int, 16, "most requests decoded at once"),
              ("--max-queue", positive_int, 64, "most requests waiting; more get 429"))
    d = p.add_argument_group("decoding defaults (a request's mtp_mode, tau, k_max, static_k "
                             "override them)")
    add_flags(d,
              ("--mode", None, None, "greedy, lossless, confadapt or static (default: "
               "confadapt where the model has <mask>, else greedy)",
               {"choices": MODES}),
              ("--tau", probability, None, "ConfAdapt threshold (default 0.9)"),
              ("--k-max", positive_int, None, "ConfAdapt, lossless: most positions per row, "
               "and the most any request may ask (default 16)"),
              ("--static-k", positive_int, 4, "static: tokens per pass"))
    d.add_argument("--load-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="choose k per pass from the load (default: on; off: every pass "
                   "computes each request's own k)")
    return p


# --- errors ---

class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error",
                 headers=None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        self.headers = headers


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body, status_code=e.status, headers=e.headers)


# --- request schemas ---

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class Options(Strict):
    """What both endpoints take."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    user: str | None = None
    mtp_mode: str | None = None
    tau: float | None = Field(None, gt=0, le=1)
    k_max: int | None = Field(None, ge=1)
    static_k: int | None = Field(None, ge=1)
    load_aware: bool | None = None


class ChatRequest(Options):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(Options):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def parse(schema, body: bytes):
    """The request body as `schema`, or a 400 that names the first bad field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        if first["type"] == "json_invalid":
            raise ApiError(400, f"malformed JSON body: {first['msg']}") from None
        where = f"{param}: " if param else ""
        raise ApiError(400, f"{where}{first['msg']}", param=param) from None


def refuse_unsupported(req):
    """A parameter the server cannot honour is a 400, never silently ignored."""
    refused = [
        ("temperature", (req.temperature or 0) > 0, "only argmax decoding (temperature 0)"),
        ("top_p", (req.top_p or 1) < 1, "only argmax decoding (top_p 1)"),
        ("n", (req.n or 1) > 1, "one choice per request (n 1)"),
        ("presence_penalty", bool(req.presence_penalty), "no penalties"),
        ("frequency_penalty", bool(req.frequency_penalty), "no penalties"),
        ("logprobs", bool(req.logprobs), "no logprobs"),
        ("top_logprobs", bool(getattr(req, "top_logprobs", None)), "no logprobs"),
        ("echo", bool(getattr(req, "echo", None)), "no echo"),
        ("suffix", getattr(req, "suffix", None) is not None, "no suffix"),
        ("best_of", (getattr(req, "best_of", None) or 1) > 1, "one choice per request"),
    ]
    for name, bad, what in refused:
        if bad:
            raise ApiError(400, f"{name} is not supported: this server decodes by {what}",
                           param=name, code="unsupported_parameter")


def decode_config(name, tau=0.9, k_max=16, static_k=4) -> DecodeConfig:
    """A mode name and its settings -> the DecodeConfig (greedy: static k = 1)."""
    if name == "greedy":
        return DecodeConfig("static", k=1)
    if name == "static":
        return DecodeConfig("static", k=static_k)
    return DecodeConfig(name, k=k_max, tau=tau, k_max=k_max)


def request_mode(req, defaults: DecodeConfig, has_mask: bool, k_top: int) -> DecodeConfig:
    """The request's decoding: its mtp_mode and settings over the server's defaults."""
    name = req.mtp_mode or describe_kind(defaults)
    if name not in MODES:
        raise ApiError(400, f"unknown mtp_mode {name!r}; choose one of {', '.join(MODES)}",
                       param="mtp_mode")
    owners = {"tau": ("confadapt",), "k_max": ("confadapt", "lossless"), "static_k": ("static",)}
    for field, modes in owners.items():
        if getattr(req, field) is not None and name not in modes:
            raise ApiError(400, f"{field} applies to mtp_mode {' or '.join(modes)}, "
                           f"not {name}", param=field)
        if field != "tau" and (getattr(req, field) or 0) > k_top:
            raise ApiError(400, f"{field} {getattr(req, field)} is above this server's "
                           f"limit of {k_top} (serve.py --k-max)", param=field)
    k_max = req.k_max or min(defaults.k_max, k_top)
    static_k = req.static_k or (defaults.k if defaults.kind == "static" else 4)
    mode = decode_config(name, req.tau or defaults.tau, k_max, min(static_k, k_top))
    if name != "greedy" and not has_mask:
        raise ApiError(400, f"mtp_mode {name} needs a <mask> token and this model has none "
                       "(only greedy works)", param="mtp_mode", code="mask_token_missing")
    return mode


def describe_kind(mode: DecodeConfig) -> str:
    return "greedy" if mode.kind == "static" and mode.k == 1 else mode.kind


# --- text as the tokens come ---

class TextStream:
    """Token ids in, text out: never part of a UTF-8 character (an incremental decoder holds
    it back), never the start of a stop string that may follow (held until it cannot be one).
    add -> (text to send, whether a stop string ended the text)."""

    def __init__(self, tokenizer, stops):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops = [s for s in stops if s]
        self.held = ""

    def add(self, ids, final=False):
        self.held += self.utf8.decode(self.tokenizer.decode_bytes(ids), final=final)
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.held[: min(hits)]
            self.held = ""
            return out, True
        # the longest end of the text that a stop string starts with stays held
        keep = 0
        if not final:
            for s in self.stops:
                for n in range(min(len(s) - 1, len(self.held)), keep, -1):
                    if self.held.endswith(s[:n]):
                        keep = n
                        break
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out):]
        return out, False


# --- metrics ---

class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value, count=1):
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += count
        self.total += value * count
        self.n += count

    def lines(self, name, help):
        out = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}",
                f"{name}_count {self.n}"]
        return out


class Metrics:
    """Counters the handlers and the decoding thread update; /metrics prints them."""

    def __init__(self):
        self.requests = {}
        self.tokens = 0
        self.passes = 0
        self.row_passes = 0
        self.cancelled = 0
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram(buckets)
        self.per_token = Histogram(buckets)

    def pass_done(self, rows: int, tokens: int):
        self.passes += 1
        self.row_passes += rows
        self.tokens += tokens

    def request(self, outcome: str):
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def render(self, live_rows: int, queued: int) -> str:
        lines = ["# TYPE mtp_requests_total counter"]
        lines += [f'mtp_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
        gauges = [("mtp_tokens_total", "counter", self.tokens),
                  ("mtp_forward_passes_total", "counter", self.passes),
                  ("mtp_row_passes_total", "counter", self.row_passes),
                  ("mtp_tokens_per_row_pass", "gauge", self.tokens / max(1, self.row_passes)),
                  ("mtp_rows_freed_by_cancel_total", "counter", self.cancelled),
                  ("mtp_live_rows", "gauge", live_rows),
                  ("mtp_queue_length", "gauge", queued)]
        for name, kind, value in gauges:
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += self.ttft.lines("mtp_time_to_first_token_seconds", "time to first token")
        lines += self.per_token.lines("mtp_time_per_output_token_seconds",
                                      "seconds between output tokens")
        return "\n".join(lines) + "\n"


# --- the app ---

def build_app(decoder, tokenizer, model, fmt, args, defaults: DecodeConfig, k_top: int):
    """The FastAPI app over `decoder` (serve.py's Decoder): the routes, auth and errors."""
    app = FastAPI(title="mtp serve.py", docs_url=None, redoc_url=None)
    name = args.served_model_name or args.model
    context = model.config.max_seq_len
    has_mask = decoder.mask_id is not None
    metrics = decoder.metrics
    created = int(time.time())

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        bearer = request.headers.get("authorization", "")
        if args.api_key and request.url.path.startswith("/v1") and \
                bearer != f"Bearer {args.api_key}":
            return error_response(ApiError(401, "invalid or missing API key (Authorization: "
                                           "Bearer KEY)", code="invalid_api_key"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        metrics.request(f"error_{e.status}")
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        metrics.request("error_500")
        return error_response(ApiError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.render(len(decoder.live), decoder.waiting.qsize()))

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "mtp"}
        return {"object": "list", "data": [card]}

    def start(req, prompt: list[int], max_tokens):
        """Check the request against the model, queue it -> (Request, its event queue)."""
        if req.model != name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server "
                           f"serves {name!r}", param="model", code="model_not_found")
        refuse_unsupported(req)
        mode = request_mode(req, defaults, has_mask, k_top)
        if not prompt:
            raise ApiError(400, "empty prompt", param="prompt")
        left = context - len(prompt)
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, left)
        if max_tokens > left or left < 1:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens "
                           f"({max_tokens}) exceeds the model's context of {context} tokens",
                           param="max_tokens", code="context_length_exceeded")
        load_aware = args.load_aware if req.load_aware is None else req.load_aware
        loop = asyncio.get_running_loop()
        events = asyncio.Queue()

        def send(kind, value):
            # a loop already closed (the server stopping) has no one to tell
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        try:
            job = decoder.submit(prompt, max_tokens, mode, load_aware, send)
        except queue.Full:
            raise ApiError(429, "the server is busy (request queue full); retry shortly",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        return job, events

    async def pieces(req, job, events):
        """(text, finish_reason or None, info) as the decoding thread sends tokens."""
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        text = TextStream(tokenizer, stops)
        begun = time.perf_counter()
        last = None
        while True:
            kind, value = await events.get()
            if kind == "error":
                raise ApiError(500, f"decoding failed: {value}", kind="server_error")
            if kind == "done":
                piece, _ = text.add([], final=True)
                yield piece, "stop" if job.row.tokens[-1] in decoder.stop_ids else "length", value
                return
            now = time.perf_counter()
            if last is None:
                metrics.ttft.observe(now - begun)
            else:
                metrics.per_token.observe((now - last) / len(value), len(value))
            last = now
            piece, stopped = text.add([t for t in value if t not in decoder.stop_ids])
            if stopped:
                # the row is freed before the next pass
                job.cancelled = True
                yield piece, "stop", {"passes": len(job.ks), "ks": list(job.ks)}
                return
            if piece:
                yield piece, None, None

    def usage(prompt, job, info, mode):
        n = len(job.row.tokens) if job.row else 0
        ks = info["ks"] if info else []
        return {"prompt_tokens": len(prompt), "completion_tokens": n,
                "total_tokens": len(prompt) + n,
                "forward_passes": len(ks), "mtp_mode": mode.describe(),
                "k_mean": sum(ks) / max(1, len(ks)), "k_max_used": max(ks, default=0)}

    async def respond(req, prompt, max_tokens, chat: bool):
        job, events = start(req, prompt, max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "created": int(time.time()), "model": name}

        def choice(text, finish, delta=False):
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text},
                    "finish_reason": finish}

        if not req.stream:
            try:
                parts = [p async for p in pieces(req, job, events)]
            finally:
                job.cancelled = True
            text = "".join(p for p, _, _ in parts)
            finish, info = parts[-1][1], parts[-1][2]
            metrics.request("ok")
            return {**head, "object": obj, "choices": [choice(text, finish)],
                    "usage": usage(prompt, job, info, job.mode)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def sse(choices, **more):
            chunk = {**head, "object": chunk_obj, "choices": choices, **more}
            return f"data: {json.dumps(chunk)}\n\n"

        async def stream():
            try:
                async for piece, finish, info in pieces(req, job, events):
                    if piece or finish:
                        yield sse([choice(piece, finish, delta=True)])
                    if finish and with_usage:
                        yield sse([], usage=usage(prompt, job, info, job.mode))
                metrics.request("ok")
            except ApiError as e:
                metrics.request(f"error_{e.status}")
                yield f"data: {json.dumps(e.body)}\n\n"
            finally:
                # a client gone (the stream is closed) frees its row before the next pass
                job.cancelled = True
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await request.body())
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
        prompt = chat_prompt(req.messages, tokenizer, model, fmt, args.no_bos)
        return await respond(req, prompt, req.max_tokens or req.max_completion_tokens, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = encode_prompt(tokenizer, model, prompt, "raw", no_bos=args.no_bos)
        elif any(not 0 <= t < model.config.vocab_size for t in prompt):
            raise ApiError(400, "a token id is outside the vocabulary", param="prompt")
        return await respond(req, prompt, req.max_tokens, False)

    return app


def chat_prompt(messages, tokenizer, model, fmt, no_bos) -> list[int]:
    """One user message in the model's chat format, as `confadapt.py --format auto --prompt`
    formats it."""
    if len(messages) != 1 or messages[0].role != "user":
        raise ApiError(400, "this server takes one user message per request (the format "
                       "confadapt.py gives its --prompt)", param="messages")
    content = messages[0].content
    if not isinstance(content, str):
        content = "".join(part.text for part in content)
    if fmt == "raw":
        return encode_prompt(tokenizer, model, content, fmt, no_bos=no_bos)
    return prompt_tokens(tokenizer, fmt, content)
