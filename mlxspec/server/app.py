"""`mlxspec serve`: the HTTP side (Starlette on uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, and (in `compat`) POST /v1/messages (Anthropic Messages) and POST
/v1/responses (OpenAI Responses). Every error is an OpenAI error object `{"error":
{"message", "type", "param", "code"}}` (on /v1/messages an Anthropic one, `{"type":
"error", "error": {"type", "message"}}`); no traceback is ever sent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from mlxspec.args import check_blas, spec_config
from mlxspec.cache import hub_repo_of
from mlxspec.errors import MlxspecError
from mlxspec.server.worker import Job, Worker
from mlxspec.tokenizer import apply_chat_template


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _openai_error(e: "APIError") -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)


# ------------------------------------------------------------------------------ validation

_MISSING = object()


def _get(body: dict, name: str, kind, default=None, *, lo=None, hi=None, lo_open=False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    else:
        ok = isinstance(v, kind)
    if not ok:
        tname = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
                 list: "an array", dict: "an object"}.get(kind, str(kind))
        raise APIError(400, f"'{name}' must be {tname}, got {json.dumps(v)[:60]}", param=name, code="invalid_type")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise APIError(400, f"'{name}' = {v} is out of range: must be {'>' if lo_open else '>='} {lo}",
                       param=name, code="invalid_value")
    if hi is not None and v > hi:
        raise APIError(400, f"'{name}' = {v} is out of range: must be <= {hi}", param=name, code="invalid_value")
    return v


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content", code="invalid_value")
            parts.append(p["text"])
        return "".join(parts)
    raise APIError(400, f"messages[{i}].content must be a string or an array of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING or msgs is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise APIError(400, "'messages' must be an array of messages", param="messages", code="invalid_type")
    if not msgs:
        raise APIError(400, "'messages' is empty: send at least one message", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role must be one of system, developer, user, assistant, tool",
                           param=f"messages[{i}].role", code="invalid_value")
        msg = {"role": "system" if role == "developer" else role}
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise APIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content",
                           code="missing_required_parameter")
        msg["content"] = "" if content is None else _content_text(content, i)
        for k in ("name", "tool_calls", "tool_call_id"):
            if k in m:
                msg[k] = m[k]
        out.append(msg)
    return out


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split generated text into (content, OpenAI tool_calls) for templates that wrap calls in
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes / Qwen style, as
    mlx_lm.server reads them). A block that is not valid JSON stays in the content."""
    calls, content, pos = [], [], 0
    while True:
        i = text.find(TOOL_OPEN, pos)
        j = text.find(TOOL_CLOSE, i + len(TOOL_OPEN)) if i >= 0 else -1
        if i < 0 or j < 0:
            content.append(text[pos:])
            break
        body = text[i + len(TOOL_OPEN): j].strip()
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            content.append(text[pos: j + len(TOOL_CLOSE)])
        else:
            content.append(text[pos:i])
            calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": name,
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        pos = j + len(TOOL_CLOSE)
    rest = "".join(content)
    return (rest.strip() or None) if calls else rest, calls


class ToolStream:
    """Streaming side of `parse_tool_calls`: passes text through until a tool-call block may
    start, then holds the rest back for parsing at the end."""

    def __init__(self):
        self.held = ""
        self.in_call = False

    def feed(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        buf = self.held + text
        i = buf.find(TOOL_OPEN)
        if i >= 0:
            self.in_call, self.held = True, buf[i:]
            return buf[:i]
        k = max((n for n in range(1, len(TOOL_OPEN)) if buf.endswith(TOOL_OPEN[:n])), default=0)
        self.held = buf[len(buf) - k:] if k else ""
        return buf[: len(buf) - k]

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse_tool_calls(self.held)
        return content or "", calls



async def collect(job, watcher) -> tuple[str, str, dict]:
    """Wait for the whole generation: (text, finish_reason, usage) or the job's APIError."""
    text = ""
    try:
        while True:
            ev = await job.events.get()
            if ev[0] == "text":
                text += ev[1]
            elif ev[0] == "error":
                raise APIError(ev[1], ev[3], ev[2], code=ev[2])
            else:
                return text, ev[1], ev[2]
    finally:
        job.cancel()  # no-op when done; stops the generation when the handler is cancelled
        watcher.cancel()


class Server:
    def __init__(self, args, worker: Worker, model_id: str):
        self.a = args
        self.worker = worker
        self.model_id = model_id
        self.created = int(time.time())
        tok = worker.tokenizer
        self.tok = tok
        self.context = int(worker.target.config.get("max_position_embeddings") or 0) or None
        self.api_key = args.api_key
        tmpl = getattr(tok, "chat_template", None) or ""
        self.tool_markup = TOOL_OPEN in tmpl or TOOL_OPEN in tok.get_vocab()

    # -- helpers -------------------------------------------------------------------
    def check_key(self, request: Request):
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")  # Anthropic's
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           "authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.a.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object", code="invalid_json")
        try:  # JSON may escape lone surrogates (\ud800), which are no text: the tokenizer would fail
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"the JSON body holds a lone surrogate (U+{ord(e.object[e.start]):04X}), which is "
                           "not text; send UTF-8 text", code="invalid_json") from None
        return data

    def common(self, body: dict) -> dict:
        model = body.get("model", _MISSING)
        if model is _MISSING or model is None:
            raise APIError(400, "'model' is required", param="model", code="missing_required_parameter")
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
        if model != self.model_id:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")
        n = _get(body, "n", int, 1)
        if n != 1:
            raise APIError(400, f"'n' = {n} is not supported: this server generates one choice (n=1)",
                           param="n", code="invalid_value")
        for k in ("logprobs", "top_logprobs", "best_of", "echo", "suffix", "logit_bias", "response_format"):
            v = body.get(k)
            fine = v is None or v is False or (k == "best_of" and v == 1) or (k == "logit_bias" and v == {}) \
                or (k == "response_format" and v == {"type": "text"})
            if not fine:
                raise APIError(400, f"'{k}' is not supported by this server", param=k, code="unsupported_parameter")
        a = self.a
        mt = _get(body, "max_completion_tokens", int, None, lo=1)
        mt = _get(body, "max_tokens", int, mt, lo=1)
        if mt is not None and mt > a.max_tokens_limit:
            raise APIError(400, f"'max_tokens' = {mt} is out of range: must be <= {a.max_tokens_limit}",
                           param="max_tokens", code="invalid_value")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise APIError(400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type")
        if len(stop) > 16:
            raise APIError(400, "'stop' holds more than 16 strings", param="stop", code="invalid_value")
        so = _get(body, "stream_options", dict, {})
        return dict(
            max_tokens=mt,
            temp=float(_get(body, "temperature", float, a.temp, lo=0.0, hi=2.0)),
            top_p=float(_get(body, "top_p", float, a.top_p, lo=0.0, hi=1.0, lo_open=True)),
            top_k=_get(body, "top_k", int, a.top_k, lo=0),
            seed=_get(body, "seed", int, a.seed, lo=0),
            stop=stop,
            stream=_get(body, "stream", bool, False),
            include_usage=bool(_get(so, "include_usage", bool, False)),
            speculative=_get(body, "speculative", bool, True),
            use_cache=_get(body, "cache_prompt", bool, True),
        )

    def finish_params(self, p: dict, ids: list[int]) -> dict:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if self.context is not None:
            if len(ids) >= self.context:
                raise APIError(400, f"the prompt has {len(ids)} tokens; the model's context is {self.context}",
                               param="messages", code="context_length_exceeded")
            room = self.context - len(ids)
            if p["max_tokens"] is not None and p["max_tokens"] > room:
                raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({p['max_tokens']}) exceeds the "
                                    f"model's context ({self.context})", param="max_tokens",
                               code="context_length_exceeded")
            if p["max_tokens"] is None:
                p["max_tokens"] = min(self.a.max_tokens, room)
        elif p["max_tokens"] is None:
            p["max_tokens"] = self.a.max_tokens
        return p

    # -- routes --------------------------------------------------------------------
    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.model_id, "queue_depth": self.worker.queue_depth})

    async def models(self, request: Request):
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlxspec"}]})

    async def metrics(self, request: Request):
        self.check_key(request)
        return PlainTextResponse(self.worker.metrics.render(self.worker.queue_depth, self.worker.cache),
                                 media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request):
        self.check_key(request)
        body = await self.read_json(request)
        p = self.common(body)
        msgs = parse_messages(body)
        tools = _get(body, "tools", list, None)
        tc = body.get("tool_choice")
        if tc == "none":
            tools = None
        ids = await self.render_prompt(msgs, tools)
        p = self.finish_params(p, ids)
        p["tools"] = bool(tools) and self.tool_markup
        return await self.run(request, "chat", p, ids)

    async def render_prompt(self, msgs: list[dict], tools: list | None, param: str = "messages") -> list[int]:
        """Chat messages (OpenAI form) -> prompt ids, through the chat template (shared by
        /v1/chat/completions, /v1/messages and /v1/responses, so one conversation is one prompt)."""
        if not self.tok.has_chat_template:
            text = "\n".join(m["content"] for m in msgs)
            return await asyncio.to_thread(self.tok.encode, text)

        def render():
            t = apply_chat_template(self.tok, msgs, add_generation_prompt=True, tools=tools or None)
            return self.tok.encode(t, add_special_tokens=False)
        try:
            return await asyncio.to_thread(render)
        except MlxspecError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    async def completions(self, request: Request):
        self.check_key(request)
        body = await self.read_json(request)
        p = self.common(body)
        prompt = body.get("prompt", _MISSING)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if prompt is _MISSING or prompt is None:
            raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "'prompt' is empty", param="prompt", code="invalid_value")
            ids = await asyncio.to_thread(self.tok.encode, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vs = self.worker.target.info.vocab_size
            if any(t < 0 or t >= vs for t in prompt):
                raise APIError(400, f"'prompt' token ids must be in [0, {vs})", param="prompt", code="invalid_value")
            ids = list(prompt)
        else:
            raise APIError(400, "'prompt' must be a string or an array of token ids (one prompt per request)",
                           param="prompt", code="invalid_type")
        return await self.run(request, "completions", self.finish_params(p, ids), ids)

    # -- running a job ---------------------------------------------------------------
    def start_job(self, request: Request, p: dict, ids: list[int]) -> tuple[Job, asyncio.Task]:
        """Queue a generation (429 when the queue is full) and watch for the client leaving."""
        job = Job(ids=ids, max_tokens=p["max_tokens"], temp=p["temp"], top_p=p["top_p"], top_k=p["top_k"],
                  seed=p["seed"], stop=p["stop"], speculative=p["speculative"], use_cache=p["use_cache"],
                  deadline=time.perf_counter() + self.a.timeout, loop=asyncio.get_running_loop())
        if not self.worker.try_submit(job):
            raise APIError(429, f"the server is busy ({self.worker.max_queue} requests queued or running); "
                                "retry later", "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        return job, asyncio.create_task(_watch_disconnect(request, job))

    async def run(self, request: Request, kind: str, p: dict, ids: list[int]):
        job, watcher = self.start_job(request, p, ids)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        if p["stream"]:
            return StreamingResponse(self.sse(job, kind, rid, p["include_usage"], watcher, p.get("tools", False)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, finish, usage = await collect(job, watcher)
        if kind == "chat":
            msg = {"role": "assistant", "content": text}
            if p.get("tools"):
                msg["content"], calls = parse_tool_calls(text)
                if calls:
                    msg["tool_calls"], finish = calls, "tool_calls"
            choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_id,
                             "system_fingerprint": "mlxspec", "choices": [choice], "usage": usage})

    async def sse(self, job: Job, kind: str, rid: str, include_usage: bool, watcher, tools: bool = False):
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text=None, finish=None, role=False, usage=_MISSING, tool_calls=None):
            if usage is not _MISSING:
                choices = []
            elif kind == "chat":
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_calls:
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
                choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            else:
                choices = [{"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}]
            d = {"id": rid, "object": obj, "created": created, "model": self.model_id,
                 "system_fingerprint": "mlxspec", "choices": choices}
            if usage is not _MISSING:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        ts = ToolStream() if tools else None
        try:
            first = True
            while True:
                ev = await job.events.get()
                if first and kind == "chat" and ev[0] != "error":
                    yield chunk("", role=True)
                first = False
                if ev[0] == "text":
                    t = ts.feed(ev[1]) if ts else ev[1]
                    if t:
                        yield chunk(t)
                elif ev[0] == "error":
                    err = {"message": ev[3], "type": ev[2], "param": None, "code": ev[2]}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    break
                else:
                    _, finish, usage = ev
                    if ts:
                        rest, calls = ts.finish()
                        if rest:
                            yield chunk(rest)
                        if calls:
                            yield chunk(tool_calls=calls)
                            finish = "tool_calls"
                    yield chunk(None if kind == "chat" else "", finish=finish)
                    if include_usage:
                        yield chunk(usage=usage)
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()
            watcher.cancel()


async def _watch_disconnect(request: Request, job: Job):
    """Cancel the job as soon as the client goes away (the body has been read, so the
    next ASGI message is the disconnect)."""
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                job.cancel()
                return
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - a broken connection is a disconnect too
        job.cancel()


def build_app(server: Server) -> Starlette:
    from mlxspec.server import compat

    metrics = server.worker.metrics

    def route(path, fn, methods, name, errors=None):
        async def handler(request: Request):
            try:
                resp = await fn(request)
            except APIError as e:
                resp = (errors or _openai_error)(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never a traceback to the client
                import traceback

                print(f"mlxspec serve: internal error on {path}:\n{traceback.format_exc()}", file=sys.stderr)
                resp = (errors or _openai_error)(APIError(500, f"internal server error ({type(e).__name__})",
                                                          "server_error", code="internal_error"))
            metrics.request(name, resp.status_code)
            return resp

        return Route(path, handler, methods=methods)

    async def http_error(request: Request, exc: HTTPException):
        codes = {404: ("not_found", "invalid_request_error"), 405: ("method_not_allowed", "invalid_request_error")}
        code, typ = codes.get(exc.status_code, ("http_error", "invalid_request_error"))
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail))
        metrics.request("other", exc.status_code)
        if request.url.path.startswith("/v1/messages"):  # Anthropic clients read Anthropic errors
            return compat.anthropic_error(APIError(exc.status_code, msg, typ, code=code,
                                                   headers=getattr(exc, "headers", None)))
        return error_response(exc.status_code, msg, typ, code=code, headers=getattr(exc, "headers", None))

    async def any_error(request: Request, exc: Exception):
        return error_response(500, "internal server error", "server_error", code="internal_error")

    routes = [
        route("/v1/chat/completions", server.chat, ["POST"], "chat"),
        route("/v1/completions", server.completions, ["POST"], "completions"),
        route("/v1/messages", lambda r: compat.messages(server, r), ["POST"], "messages", compat.anthropic_error),
        route("/v1/messages/count_tokens", lambda r: compat.count_tokens(server, r), ["POST"], "count_tokens",
              compat.anthropic_error),
        route("/v1/responses", lambda r: compat.responses(server, r), ["POST"], "responses"),
        route("/v1/models", server.models, ["GET"], "models"),
        route("/health", server.health, ["GET"], "health"),
        route("/metrics", server.metrics, ["GET"], "metrics"),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: any_error})


# ------------------------------------------------------------------------------ command line

def cmd_serve(a) -> int:
    import uvicorn

    check_blas()
    max_batch = getattr(a, "max_batch", None)
    for name, v, lo in (("--port", a.port, 0), ("--max-queue", a.max_queue, 1), ("--max-tokens-limit", a.max_tokens_limit, 1),
                        ("--max-batch", 1 if max_batch is None else max_batch, 1),
                        ("--max-body-bytes", a.max_body_bytes, 1), ("--prompt-cache-bytes", a.prompt_cache_bytes, 0)):
        if v < lo:
            raise MlxspecError(f"{name} {v} is out of range: use {lo} or more")
    if a.port > 65535:
        raise MlxspecError(f"--port {a.port} is out of range: use 0..65535")
    if not a.timeout > 0:
        raise MlxspecError(f"--timeout {a.timeout} must be positive")
    load_kw = dict(model=a.model, config=spec_config(a))
    worker = Worker(load_kw, a.prompt_cache_bytes, a.max_queue, max_batch=max_batch)
    worker.start()  # loads on the generation thread; MlxspecError -> one line, exit 2
    src = worker.target.info.source or a.model or "SmolLM2-135M-Instruct"
    # as mlx_lm.server: a hub id is served under its repo id, not its snapshot's commit hash
    model_id = a.model_id or hub_repo_of(src) or Path(str(src).rstrip("/")).stem
    server = Server(a, worker, model_id)
    app = build_app(server)

    stopping = {"sig": None}

    def on_signal(sig, frame):  # uvicorn re-raises the signal after its shutdown: absorb it
        stopping["sig"] = sig

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cfg = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning", access_log=False,
                         timeout_graceful_shutdown=5, lifespan="off")
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C / SIGTERM: cancel in-flight generations now
            worker.cancel_all()
            super().handle_exit(sig, frame)

    srv = _Server(cfg)
    batch = f", batches of up to {worker.max_batch}" if worker.batch is not None else ""
    print(f"mlxspec serve: {model_id} ({worker.spec.description}{batch}) on http://{a.host}:{a.port}/v1"
          f"{' (API key required)' if a.api_key else ''}", file=sys.stderr, flush=True)
    try:
        srv.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        pass
    finally:
        worker.stop()
    if not srv.started:
        print(f"mlxspec: error: could not listen on {a.host}:{a.port} (in use or not allowed); pick another --port",
              file=sys.stderr)
        code = 2
    else:
        print("mlxspec serve: stopped", file=sys.stderr)
        code = 0
    # Leave without running C++ static destructors: MLX's per-thread stream machinery for the
    # generation thread can abort the process at exit ("terminate called without an active
    # exception") after an otherwise clean shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
