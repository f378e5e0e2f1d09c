"""Tool calls in generated text: `<tool_call>{...}</tool_call>` blocks (Hermes / Qwen style) to
OpenAI `tool_calls`, whole (`parse_tool_calls`) or while streaming (`ToolStream`)."""

from __future__ import annotations

import json
import secrets

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

