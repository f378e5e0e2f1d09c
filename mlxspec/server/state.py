"""`Server`: what every handler shares (the flags, the worker, its tokenizer, the served model
id, the model's context length), with the request steps as methods so that the OpenAI handlers
(`completions`, `status`) and the Anthropic / Responses ones (`compat`) run them the same way.
The steps themselves live in `params` and `jobs`."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from mlxspec.server import jobs, params
from mlxspec.server.tools import TOOL_OPEN
from mlxspec.server.job import Job
from mlxspec.server.worker import Worker


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

    def check_key(self, request: Request):
        """401 unless the request carries one of the keys; which one is its tenant (its jobs draft
        from that key's suffix index: `Worker.tenant_spec`)."""
        request.state.tenant = params.check_key(self.api_key, request)

    async def read_json(self, request: Request) -> dict:
        return await params.read_json(request, self.a.max_body_bytes)

    def common(self, body: dict) -> dict:
        return params.common(body, self.model_id, self.a)

    def finish_params(self, p: dict, ids: list[int]) -> dict:
        return params.finish_params(p, ids, self.context, self.a.max_tokens)

    async def render_prompt(self, msgs: list[dict], tools: list | None, param: str = "messages") -> list[int]:
        return await params.render_prompt(self.tok, msgs, tools, param)

    def start_job(self, request: Request, p: dict, ids: list[int]) -> tuple[Job, asyncio.Task]:
        return jobs.start_job(self.worker, self.a.timeout, request, p, ids)
