"""Two more request formats over the same generation path as /v1/chat/completions:

- `POST /v1/messages`: the Anthropic Messages API (errors as Anthropic's
  `{"type": "error", "error": {"type", "message"}}`, streams as its SSE events);
- `POST /v1/responses`: the OpenAI Responses API (stateless: no stored responses).

Each request is turned into the OpenAI chat messages that mean the same conversation and
rendered by `Server.render_prompt`, so it gets the prompt ids, and greedy text, that
/v1/chat/completions gets; it is queued by `Server.start_job` (429, cancellation, prefix
cache, stop strings as there). Tool calls come back only from templates that use the
`<tool_call>` markup (`Server.tool_markup`, as on /v1/chat/completions).
"""

from __future__ import annotations

import json
import secrets
import sys
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from mlxspec.server.errors import APIError
from mlxspec.server.jobs import collect
from mlxspec.server.params import _MISSING, _get, messages_array
from mlxspec.server.tools import ToolStream, parse_tool_calls

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
NO_TOOLS_WARNING = ("tools ignored for tool calls: this model's chat template defines no <tool_call> markup, "
                    "so it answers in text only")
_warned = {"tools": False}


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _tool_input(arguments: str) -> dict:
    try:
        v = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return v if isinstance(v, dict) else {"arguments": v}


def _tools_mode(server, tools, forced: bool, param: str) -> tuple[bool, dict]:
    """Whether tool calls are parsed from the output; headers that say when they cannot be."""
    if not tools:
        return False, {}
    if server.tool_markup:
        return True, {}
    if forced:
        raise APIError(400, f"'{param}' forces a tool call, but this model's chat template defines no "
                            "<tool_call> markup, so it cannot call tools", param=param, code="unsupported_parameter")
    if not _warned["tools"]:
        _warned["tools"] = True
        print(f"mlxspec serve: {NO_TOOLS_WARNING}", file=sys.stderr, flush=True)
    return False, {"x-mlxspec-warning": NO_TOOLS_WARNING}


def _text_parts(content, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or an array of text parts of the given types: their text, joined (as
    /v1/chat/completions joins text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or an array of {' / '.join(kinds)} blocks",
                       param=where, code="invalid_type")
    out = []
    for j, b in enumerate(content):
        t = b.get("type") if isinstance(b, dict) else None
        if t not in kinds or not isinstance(b.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text blocks ({' / '.join(kinds)}, with a string 'text') are "
                                f"supported here, got {json.dumps(t)}", param=f"{where}[{j}]", code="invalid_value")
        out.append(b["text"])
    return "".join(out)


# ====================================================================== Anthropic Messages

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_type(status: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(e: APIError) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": anthropic_error_type(e.status), "message": e.message}},
                        status_code=e.status, headers=e.headers)


def anthropic_to_chat(body: dict) -> list[dict]:
    """`system` + `messages` of a Messages request -> OpenAI chat messages. tool_use blocks
    become the assistant's `tool_calls` (arguments as an object, which tool templates render
    as JSON), tool_result blocks become `tool` messages (before the rest of their user turn)."""
    out = []
    system = body.get("system")
    if system is not None:
        s = _text_parts(system, "system", ("text",))
        if s:
            out.append({"role": "system", "content": s})
    msgs = messages_array(body)
    names = {}  # tool_use id -> tool name, for the tool messages that answer it
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object", param=where, code="invalid_type")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant' (a system prompt goes in the "
                                "top-level 'system')", param=f"{where}.role", code="invalid_value")
        content = m.get("content", _MISSING)
        if content is _MISSING or content is None:
            raise APIError(400, f"{where}.content is required", param=f"{where}.content",
                           code="missing_required_parameter")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content must be a string or an array of content blocks",
                           param=f"{where}.content", code="invalid_type")
        texts, calls, results = [], [], []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            t = b.get("type") if isinstance(b, dict) else None
            if t == "text":
                if not isinstance(b.get("text"), str):
                    raise APIError(400, f"{w}.text must be a string", param=f"{w}.text", code="invalid_type")
                texts.append(b["text"])
            elif t == "tool_use" and role == "assistant":
                if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                        and isinstance(b.get("input", {}), dict)):
                    raise APIError(400, f"{w}: a tool_use block needs a string 'id' and 'name' and an object 'input'",
                                   param=w, code="invalid_value")
                names[b["id"]] = b["name"]
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif t == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise APIError(400, f"{w}.tool_use_id must be a string", param=f"{w}.tool_use_id",
                                   code="invalid_value")
                c = b.get("content")
                text = "" if c is None else _text_parts(c, f"{w}.content", ("text",))
                if b.get("is_error"):
                    text = f"Error: {text}"
                msg = {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}
                if b["tool_use_id"] in names:
                    msg["name"] = names[b["tool_use_id"]]
                results.append(msg)
            elif t in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not rendered back
            elif t in ("image", "document"):
                raise APIError(400, f"{w}: {t} blocks are not supported: this server serves a text-only model",
                               param=w, code="unsupported_parameter")
            else:
                allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
                raise APIError(400, f"{w}: unsupported content block type {json.dumps(t)} in a {role} message "
                                    f"(supported: {allowed})", param=w, code="invalid_value")
        out.extend(results)
        if texts or calls or not results:
            msg = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def anthropic_tools(body: dict) -> tuple[list | None, bool]:
    """`tools` (client tools: name, description, input_schema) as OpenAI function tools for the
    chat template, and whether `tool_choice` forces a call ('any' or 'tool')."""
    tools = _get(body, "tools", list, None)
    tc = body.get("tool_choice")
    if tc is not None and not (isinstance(tc, dict) and tc.get("type") in ("auto", "any", "tool", "none")):
        raise APIError(400, "'tool_choice' must be an object with 'type' auto, any, tool or none",
                       param="tool_choice", code="invalid_value")
    kind = tc["type"] if tc else "auto"
    if not tools or kind == "none":
        return None, False
    out = []
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"]):
            raise APIError(400, f"tools[{i}] must be an object with a string 'name'", param=f"tools[{i}]",
                           code="invalid_value")
        if t.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: the server tool {json.dumps(t.get('type'))} is not supported; only "
                                "client tools ({name, description, input_schema})", param=f"tools[{i}]",
                           code="unsupported_parameter")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise APIError(400, f"tools[{i}].input_schema must be an object", param=f"tools[{i}].input_schema",
                           code="invalid_type")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out, kind in ("any", "tool")


def anthropic_usage(u: dict) -> dict:
    """Anthropic counts: input_tokens is the part of the prompt not read from the prompt cache."""
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": u["completion_tokens"], "mlxspec": u["mlxspec"]}


def anthropic_stop(finish: str, stop_sequence: str | None, calls: list) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return "end_turn", None


def anthropic_blocks(text: str, calls: list) -> list[dict]:
    blocks = [{"type": "text", "text": text}] if (text or not calls) else []
    for c in calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["function"]["name"],
                       "input": _tool_input(c["function"]["arguments"])})
    return blocks


async def messages(server, request: Request):
    server.check_key(request)
    body = await server.read_json(request)
    if body.get("max_tokens") is None:
        raise APIError(400, "'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    _get(body, "temperature", float, None, lo=0.0, hi=1.0)
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop_sequences' must be an array of strings", param="stop_sequences",
                       code="invalid_type")
    p = server.common({"model": body.get("model"), "max_tokens": body.get("max_tokens"), "stop": stop,
                       **{k: body[k] for k in ("temperature", "top_p", "top_k", "stream", "seed", "speculative",
                                               "cache_prompt") if k in body}})
    msgs = anthropic_to_chat(body)
    tools, forced = anthropic_tools(body)
    parse_calls, headers = _tools_mode(server, tools, forced, "tool_choice")
    ids = await server.render_prompt(msgs, tools)
    p = server.finish_params(p, ids)
    job, watcher = server.start_job(request, p, ids)
    mid = "msg_" + secrets.token_hex(12)
    if p["stream"]:
        return StreamingResponse(_anthropic_sse(server, job, watcher, mid, len(ids), parse_calls),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    text, finish, usage = await collect(job, watcher)
    calls = []
    if parse_calls:
        content, calls = parse_tool_calls(text)
        text = content or ""
    reason, seq = anthropic_stop(finish, job.stop_sequence, calls)
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": server.model_id,
                         "content": anthropic_blocks(text, calls), "stop_reason": reason, "stop_sequence": seq,
                         "usage": anthropic_usage(usage)}, headers=headers)


async def count_tokens(server, request: Request):
    """`POST /v1/messages/count_tokens`: the prompt's token count, as /v1/messages would render it
    (coding agents ask before a request)."""
    server.check_key(request)
    body = await server.read_json(request)
    server.common({"model": body.get("model")})
    tools, _ = anthropic_tools(body)
    ids = await server.render_prompt(anthropic_to_chat(body), tools)
    return JSONResponse({"input_tokens": len(ids)})


async def _anthropic_sse(server, job, watcher, mid: str, n_prompt: int, parse_calls: bool):
    ts = ToolStream() if parse_calls else None
    index, text_open = 0, False

    def start_text():
        out = _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}})
        return out + _sse("ping", {"type": "ping"})

    try:
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": server.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": n_prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0}}})
        while True:
            ev = await job.events.get()
            if ev[0] == "text":
                t = ts.feed(ev[1]) if ts else ev[1]
                if t:
                    if not text_open:
                        text_open = True
                        yield start_text()
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                       "delta": {"type": "text_delta", "text": t}})
            elif ev[0] == "error":
                yield _sse("error", {"type": "error", "error": {"type": anthropic_error_type(ev[1]),
                                                                "message": ev[3]}})
                break
            else:
                _, finish, usage = ev
                calls = []
                if ts:
                    rest, calls = ts.finish()
                    if rest:
                        if not text_open:
                            text_open = True
                            yield start_text()
                        yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                           "delta": {"type": "text_delta", "text": rest}})
                if not text_open and not calls:
                    text_open = True
                    yield start_text()
                if text_open:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                    index = 1
                for b in (anthropic_blocks("", calls) if calls else []):
                    yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {**b, "input": {}}})
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(b["input"])}})
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                reason, seq = anthropic_stop(finish, job.stop_sequence, calls)
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": reason, "stop_sequence": seq},
                                             "usage": anthropic_usage(usage)})
                yield _sse("message_stop", {"type": "message_stop"})
                break
    finally:
        job.cancel()
        watcher.cancel()


# ====================================================================== OpenAI Responses

def responses_to_chat(body: dict) -> list[dict]:
    """`instructions` + `input` (a string, or message / function_call / function_call_output
    items) -> OpenAI chat messages."""
    out = []
    instr = body.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise APIError(400, "'instructions' must be a string", param="instructions", code="invalid_type")
        if instr:
            out.append({"role": "system", "content": instr})
    inp = body.get("input", _MISSING)
    if inp is _MISSING or inp is None:
        raise APIError(400, "'input' is required", param="input", code="missing_required_parameter")
    if isinstance(inp, str):
        return out + [{"role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise APIError(400, "'input' must be a string or an array of input items", param="input", code="invalid_type")
    if not inp:
        raise APIError(400, "'input' is empty: send at least one message", param="input", code="invalid_value")
    names = {}
    for i, it in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise APIError(400, f"{where} must be an object", param=where, code="invalid_type")
        typ = it.get("type", "message")
        if typ == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be one of user, assistant, system, developer",
                               param=f"{where}.role", code="invalid_value")
            c = it.get("content", _MISSING)
            if c is _MISSING or c is None:
                raise APIError(400, f"{where}.content is required", param=f"{where}.content",
                               code="missing_required_parameter")
            text = _text_parts(c, f"{where}.content", ("input_text", "output_text", "text"))
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif typ == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call item needs string 'call_id', 'name' and 'arguments'",
                               param=where, code="invalid_value")
            names[it["call_id"]] = it["name"]
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": _tool_input(it["arguments"])}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif typ == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise APIError(400, f"{where}.call_id must be a string", param=f"{where}.call_id",
                               code="invalid_value")
            text = _text_parts(it.get("output", ""), f"{where}.output", ("input_text", "output_text", "text"))
            msg = {"role": "tool", "tool_call_id": it["call_id"], "content": text}
            if it["call_id"] in names:
                msg["name"] = names[it["call_id"]]
            out.append(msg)
        elif typ == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: unsupported input item type {json.dumps(typ)} (supported: message, "
                                "function_call, function_call_output)", param=where, code="invalid_value")
    return out


def responses_tools(body: dict) -> tuple[list | None, bool]:
    tools = _get(body, "tools", list, None)
    tc = body.get("tool_choice")
    if tc == "none" or not tools:
        return None, False
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}]: only function tools ({{type: 'function', name, parameters}}) are "
                                "supported", param=f"tools[{i}]", code="unsupported_parameter")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out, tc == "required" or isinstance(tc, dict)


def responses_usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"], "mlxspec": u["mlxspec"]}


def _message_item(mid: str, text: str, status: str) -> dict:
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_items(calls: list) -> list[dict]:
    return [{"id": "fc_" + c["id"][5:], "type": "function_call", "status": "completed", "call_id": c["id"],
             "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


async def responses(server, request: Request):
    server.check_key(request)
    body = await server.read_json(request)
    mot = _get(body, "max_output_tokens", int, None, lo=1)
    if mot is not None and mot > server.a.max_tokens_limit:
        raise APIError(400, f"'max_output_tokens' = {mot} is out of range: must be <= {server.a.max_tokens_limit}",
                       param="max_output_tokens", code="invalid_value")
    if body.get("previous_response_id") is not None:
        raise APIError(400, "'previous_response_id' is not supported: this server stores no responses; send the "
                            "whole conversation in 'input'", param="previous_response_id",
                       code="unsupported_parameter")
    if body.get("background"):
        raise APIError(400, "'background' is not supported", param="background", code="unsupported_parameter")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt not in (None, {"type": "text"}):
        raise APIError(400, "'text.format' other than {\"type\": \"text\"} is not supported", param="text.format",
                       code="unsupported_parameter")
    p = server.common({"model": body.get("model"), "max_tokens": mot,
                       **{k: body[k] for k in ("temperature", "top_p", "top_k", "stream", "seed", "stop",
                                               "speculative", "cache_prompt") if k in body}})
    msgs = responses_to_chat(body)
    tools, forced = responses_tools(body)
    parse_calls, headers = _tools_mode(server, tools, forced, "tool_choice")
    ids = await server.render_prompt(msgs, tools, param="input")
    p = server.finish_params(p, ids)
    job, watcher = server.start_job(request, p, ids)
    rid, created = "resp_" + secrets.token_hex(12), int(time.time())

    def response(status, output, usage=None, finish=None, error=None):
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": body.get("instructions"), "max_output_tokens": mot, "model": server.model_id,
                "output": output, "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": p["temp"],
                "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "top_p": p["top_p"], "truncation": "disabled",
                "usage": usage, "metadata": body.get("metadata") or {}}

    if p["stream"]:
        return StreamingResponse(_responses_sse(job, watcher, response, parse_calls),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    text, finish, usage = await collect(job, watcher)
    calls = []
    if parse_calls:
        content, calls = parse_tool_calls(text)
        text = content or ""
    status = "incomplete" if finish == "length" else "completed"
    output = ([_message_item("msg_" + secrets.token_hex(12), text, status)] if (text or not calls) else []) \
        + _call_items(calls)
    return JSONResponse(response(status, output, responses_usage(usage), finish), headers=headers)


async def _responses_sse(job, watcher, response, parse_calls: bool):
    seq = [0]
    ts = ToolStream() if parse_calls else None
    mid = "msg_" + secrets.token_hex(12)
    text, opened = "", False

    def ev(typ, **data):
        out = _sse(typ, {"type": typ, "sequence_number": seq[0], **data})
        seq[0] += 1
        return out

    def open_message():
        return (ev("response.output_item.added", output_index=0, item={**_message_item(mid, "", "in_progress"),
                                                                          "content": []})
                + ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": []}))

    try:
        yield ev("response.created", response=response("in_progress", []))
        yield ev("response.in_progress", response=response("in_progress", []))
        while True:
            e = await job.events.get()
            if e[0] == "text":
                t = ts.feed(e[1]) if ts else e[1]
                if t:
                    if not opened:
                        opened = True
                        yield open_message()
                    text += t
                    yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=t,
                             logprobs=[])
            elif e[0] == "error":
                yield ev("error", code=e[2], message=e[3], param=None)
                yield ev("response.failed", response=response("failed", [], error={"code": e[2], "message": e[3]}))
                break
            else:
                _, finish, usage = e
                calls = []
                if ts:
                    rest, calls = ts.finish()
                    if rest:
                        if not opened:
                            opened = True
                            yield open_message()
                        text += rest
                        yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                                 delta=rest, logprobs=[])
                status = "incomplete" if finish == "length" else "completed"
                output = []
                if not opened and not calls:
                    opened = True
                    yield open_message()
                if opened:
                    item = _message_item(mid, text, status)
                    yield ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text,
                             logprobs=[])
                    yield ev("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                             part=item["content"][0])
                    yield ev("response.output_item.done", output_index=0, item=item)
                    output.append(item)
                for item in _call_items(calls):
                    i = len(output)
                    yield ev("response.output_item.added", output_index=i, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
                    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                             delta=item["arguments"])
                    yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             arguments=item["arguments"])
                    yield ev("response.output_item.done", output_index=i, item=item)
                    output.append(item)
                final = response(status, output, responses_usage(usage), finish)
                yield ev("response.incomplete" if status == "incomplete" else "response.completed", response=final)
                break
    finally:
        job.cancel()
        watcher.cancel()
