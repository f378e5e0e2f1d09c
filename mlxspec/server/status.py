"""The GET endpoints: /health (no key needed), /v1/models and /metrics (Prometheus text)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

if TYPE_CHECKING:
    from mlxspec.server.state import Server


async def health(server: Server, request: Request):
    return JSONResponse({"status": "ok", "model": server.model_id, "queue_depth": server.worker.queue_depth})


async def models(server: Server, request: Request):
    server.check_key(request)
    return JSONResponse({"object": "list", "data": [
        {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "mlxspec"}]})


async def metrics(server: Server, request: Request):
    server.check_key(request)
    w = server.worker
    return PlainTextResponse(w.metrics.render(w.queue_depth, w.cache, w.suffix_indexes()),
                             media_type="text/plain; version=0.0.4")
