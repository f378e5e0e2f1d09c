"""Request parsing and validation: a JSON body to the parameters of the worker's `Job`.

`check_key` (the API key), `read_json` (the bounded body), `common` (the fields every
generation endpoint shares), `parse_messages` (OpenAI chat messages), `render_prompt` (messages
to prompt ids through the chat template) and `finish_params` (the prompt against the model's
context). Each failure is an `APIError` (400, 401, 404 or 413) naming the field."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math

from starlette.requests import Request

from mlxspec.errors import MlxspecError
from mlxspec.server.errors import APIError
from mlxspec.tokenizer import apply_chat_template

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


def messages_array(body: dict) -> list:
    """body["messages"]: a non-empty array, else the 400 naming what is wrong (Chat
    Completions and Anthropic Messages alike)."""
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING or msgs is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise APIError(400, "'messages' must be an array of messages", param="messages", code="invalid_type")
    if not msgs:
        raise APIError(400, "'messages' is empty: send at least one message", param="messages", code="invalid_value")
    return msgs


def parse_messages(body: dict) -> list[dict]:
    msgs = messages_array(body)
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


def check_key(api_key: str | None, request: Request) -> str | None:
    """The request's key -> its tenant (--api-key KEY1,KEY2,...): a digest of the key, the same
    for the same key in any order and any run (what `--suffix-cache` files name), never the
    key; None when the server has no key; 401 when it matches none."""
    if not api_key:
        return None
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")  # Anthropic's
    found = None
    for key in (k for k in api_key.split(",") if k):
        if hmac.compare_digest(given.encode(), key.encode()) and found is None:  # every key compared: no timing
            found = hashlib.sha256(b"mlxspec-tenant|" + key.encode()).hexdigest()[:16]
    if found is None:
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       "authentication_error", code="invalid_api_key")
    return found


async def read_json(request: Request, limit: int) -> dict:
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


def common(body: dict, model_id: str, a) -> dict:
    """The fields /v1/chat/completions, /v1/completions, /v1/messages and /v1/responses share;
    `a` holds the command's defaults and limits."""
    model = body.get("model", _MISSING)
    if model is _MISSING or model is None:
        raise APIError(400, "'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
    if model != model_id:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_id}'",
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


def finish_params(p: dict, ids: list[int], context: int | None, default_max_tokens: int) -> dict:
    """Check the prompt against the model's context and fill in the default max_tokens."""
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    if context is not None:
        if len(ids) >= context:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the model's context is {context}",
                           param="messages", code="context_length_exceeded")
        room = context - len(ids)
        if p["max_tokens"] is not None and p["max_tokens"] > room:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({p['max_tokens']}) exceeds the "
                                f"model's context ({context})", param="max_tokens",
                           code="context_length_exceeded")
        if p["max_tokens"] is None:
            p["max_tokens"] = min(default_max_tokens, room)
    elif p["max_tokens"] is None:
        p["max_tokens"] = default_max_tokens
    return p


async def render_prompt(tok, msgs: list[dict], tools: list | None, param: str = "messages") -> list[int]:
    """Chat messages (OpenAI form) -> prompt ids, through the chat template (shared by
    /v1/chat/completions, /v1/messages and /v1/responses, so one conversation is one prompt)."""
    if not tok.has_chat_template:
        text = "\n".join(m["content"] for m in msgs)
        return await asyncio.to_thread(tok.encode, text)

    def render():
        t = apply_chat_template(tok, msgs, add_generation_prompt=True, tools=tools or None)
        return tok.encode(t, add_special_tokens=False)
    try:
        return await asyncio.to_thread(render)
    except MlxspecError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
