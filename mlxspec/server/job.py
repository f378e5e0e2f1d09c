"""`Job`: one request as the generation thread sees it (its prompt ids and sampling, its
deadline, the queue its events go back on, and the flag that cancels it)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    temp: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    speculative: bool
    use_cache: bool
    deadline: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    stop_sequence: str | None = None  # set before "done": the stop string that ended it (None: EOS or length)
    tenant: str | None = None  # which API key sent it (`params.check_key`); None: the server has no key

    def cancel(self):
        self.cancelled.set()

    def post(self, *ev):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
