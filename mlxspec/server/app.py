"""`mlxspec serve`: the HTTP side (Starlette on uvicorn): `build_app` puts the routes together,
`cmd_serve` runs them.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, and (in `compat`) POST /v1/messages (Anthropic Messages) and POST
/v1/responses (OpenAI Responses). Every error is an OpenAI error object `{"error":
{"message", "type", "param", "code"}}` (on /v1/messages an Anthropic one, `{"type":
"error", "error": {"type", "message"}}`); no traceback is ever sent.

The parts, one module each:
- `errors`: `APIError` and the OpenAI error response;
- `params`: request parsing and validation (API key, JSON body, fields, messages, prompt);
- `tools`: `<tool_call>` blocks to OpenAI tool calls, whole or streamed;
- `jobs`: queueing a `Job` on the worker, watching for disconnects, `collect` (non-streaming);
- `sse`: the server-sent events of a streamed chat / text completion;
- `completions`: POST /v1/chat/completions and /v1/completions;
- `status`: GET /health, /v1/models and /metrics;
- `state`: `Server`, what the handlers share.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from mlxspec.args import check_blas, spec_config
from mlxspec.cache import hub_repo_of
from mlxspec.errors import MlxspecError
from mlxspec.server import compat, completions, status
from mlxspec.server.errors import APIError, error_response, openai_error
from mlxspec.server.jobs import collect
from mlxspec.server.params import _MISSING, _get, parse_messages
from mlxspec.server.state import Server
from mlxspec.server.tools import TOOL_CLOSE, TOOL_OPEN, ToolStream, parse_tool_calls
from mlxspec.server.worker import Worker

__all__ = ["APIError", "Server", "TOOL_CLOSE", "TOOL_OPEN", "ToolStream", "_MISSING", "_get", "build_app",
           "cmd_serve", "collect", "error_response", "parse_messages", "parse_tool_calls"]


def build_app(server: Server) -> Starlette:
    metrics = server.worker.metrics

    def route(path, fn, methods, name, errors=None, generates=False):
        async def handler(request: Request):
            if generates:  # counted until its job is queued: a burst is admitted together
                request.state.arrival = server.worker.arrival()
            try:
                resp = await fn(request)
            except APIError as e:
                resp = (errors or openai_error)(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never a traceback to the client
                import traceback

                print(f"mlxspec serve: internal error on {path}:\n{traceback.format_exc()}", file=sys.stderr)
                resp = (errors or openai_error)(APIError(500, f"internal server error ({type(e).__name__})",
                                                         "server_error", code="internal_error"))
            finally:
                if generates:
                    request.state.arrival.close()  # (a no-op once the job was queued)
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
        route("/v1/chat/completions", lambda r: completions.chat(server, r), ["POST"], "chat", generates=True),
        route("/v1/completions", lambda r: completions.completions(server, r), ["POST"], "completions", generates=True),
        route("/v1/messages", lambda r: compat.messages(server, r), ["POST"], "messages", compat.anthropic_error, generates=True),
        route("/v1/messages/count_tokens", lambda r: compat.count_tokens(server, r), ["POST"], "count_tokens",
              compat.anthropic_error),
        route("/v1/responses", lambda r: compat.responses(server, r), ["POST"], "responses", generates=True),
        route("/v1/models", lambda r: status.models(server, r), ["GET"], "models"),
        route("/health", lambda r: status.health(server, r), ["GET"], "health"),
        route("/metrics", lambda r: status.metrics(server, r), ["GET"], "metrics"),
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
    every = getattr(a, "suffix_cache_every", 60.0)
    if not 0 <= every < float("inf"):
        raise MlxspecError(f"--suffix-cache-every {every} is out of range: use a number of seconds, 0 or more "
                           "(0 saves at shutdown only)")
    load_kw = dict(model=a.model, config=spec_config(a))
    worker = Worker(load_kw, a.prompt_cache_bytes, a.max_queue, max_batch=max_batch,
                    share_keys=getattr(a, "suffix_share_keys", False), suffix_cache=getattr(a, "suffix_cache", None),
                    suffix_cache_every=every)
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
