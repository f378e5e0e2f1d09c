"""Running a request: queue its `Job` on the worker (`start_job`, 429 when the queue is full),
cancel it when the client leaves (`watch_disconnect`), and wait for the whole generation for a
non-streaming answer (`collect`)."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from mlxspec.server.errors import APIError
from mlxspec.server.job import Job
from mlxspec.server.worker import Worker


def start_job(worker: Worker, timeout: float, request: Request, p: dict,
              ids: list[int]) -> tuple[Job, asyncio.Task]:
    """Queue a generation on `worker`, due within `timeout` seconds (429 when the queue is full),
    and watch for the client leaving."""
    job = Job(ids=ids, max_tokens=p["max_tokens"], temp=p["temp"], top_p=p["top_p"], top_k=p["top_k"],
              seed=p["seed"], stop=p["stop"], speculative=p["speculative"], use_cache=p["use_cache"],
              deadline=time.perf_counter() + timeout, loop=asyncio.get_running_loop(),
              tenant=getattr(request.state, "tenant", None))
    submitted = worker.try_submit(job)
    arrival = getattr(request.state, "arrival", None)
    if arrival is not None:
        arrival.close()  # submitted (or refused): no longer on its way in
    if not submitted:
        raise APIError(429, f"the server is busy ({worker.max_queue} requests queued or running); "
                            "retry later", "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
    return job, asyncio.create_task(watch_disconnect(request, job))


async def watch_disconnect(request: Request, job: Job):
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
