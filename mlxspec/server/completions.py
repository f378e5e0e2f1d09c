"""The OpenAI generation endpoints: POST /v1/chat/completions (`chat`) and POST /v1/completions
(`completions`), answered as server-sent events (`sse`) or as one JSON object (`run`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from mlxspec.server.errors import APIError
from mlxspec.server.jobs import collect
from mlxspec.server.params import _MISSING, _get, parse_messages
from mlxspec.server.sse import sse
from mlxspec.server.tools import parse_tool_calls

if TYPE_CHECKING:
    from mlxspec.server.state import Server


async def chat(server: Server, request: Request):
    server.check_key(request)
    body = await server.read_json(request)
    p = server.common(body)
    msgs = parse_messages(body)
    tools = _get(body, "tools", list, None)
    tc = body.get("tool_choice")
    if tc == "none":
        tools = None
    ids = await server.render_prompt(msgs, tools)
    p = server.finish_params(p, ids)
    p["tools"] = bool(tools) and server.tool_markup
    return await run(server, request, "chat", p, ids)


async def completions(server: Server, request: Request):
    server.check_key(request)
    body = await server.read_json(request)
    p = server.common(body)
    prompt = body.get("prompt", _MISSING)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is _MISSING or prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt", code="invalid_value")
        ids = await asyncio.to_thread(server.tok.encode, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vs = server.worker.target.info.vocab_size
        if any(t < 0 or t >= vs for t in prompt):
            raise APIError(400, f"'prompt' token ids must be in [0, {vs})", param="prompt", code="invalid_value")
        ids = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string or an array of token ids (one prompt per request)",
                       param="prompt", code="invalid_type")
    return await run(server, request, "completions", server.finish_params(p, ids), ids)


async def run(server: Server, request: Request, kind: str, p: dict, ids: list[int]):
    """Start the job; stream it, or collect it into one chat.completion / text_completion."""
    job, watcher = server.start_job(request, p, ids)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
    if p["stream"]:
        return StreamingResponse(sse(server.model_id, job, kind, rid, p["include_usage"], watcher,
                                     p.get("tools", False)),
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
    return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": server.model_id,
                         "system_fingerprint": "mlxspec", "choices": [choice], "usage": usage})
