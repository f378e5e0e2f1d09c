"""Server-sent events for /v1/chat/completions and /v1/completions with `"stream": true`:
one `data: {chunk}` per piece of text, the finish chunk, the usage chunk when asked for, and
`data: [DONE]`; an error after the headers went out is one `data: {"error": ...}` event."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from mlxspec.server.params import _MISSING
from mlxspec.server.tools import ToolStream
from mlxspec.server.job import Job


async def sse(model_id: str, job: Job, kind: str, rid: str, include_usage: bool, watcher,
              tools: bool = False) -> AsyncIterator[str]:
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
        d = {"id": rid, "object": obj, "created": created, "model": model_id,
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

