"""The generation thread: one model, one generation at a time, a bounded FIFO in front.

HTTP handlers (asyncio) submit `Job`s; the thread runs them in arrival order through
`api.stream_generate` with the server's drafter and the prompt cache, and posts events
back into the job's event loop:

    ("text", str)                      text committed by one step (a token group)
    ("done", finish_reason, usage)     the end; usage as in the OpenAI response
    ("error", status, type, message)   the job failed (no traceback leaves the server)

A job stops within one step of `cancel()` (client gone, shutdown) or of its deadline.
All MLX work (loading included) happens on this thread.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from mlxspec import api
from mlxspec.server.prompt_cache import ContextDrafter, PromptCache

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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

    def cancel(self):
        self.cancelled.set()

    def post(self, *ev):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple, int] = {}
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.drafted = self.accepted = self.forwards = self.spec_generated = 0
        self.cancelled = self.timeouts = 0
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum, self.ttft_count = 0.0, 0

    def request(self, route: str, status: int):
        with self.lock:
            k = (route, status)
            self.requests[k] = self.requests.get(k, 0) + 1

    def first_token(self, seconds: float):
        with self.lock:
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
            self.ttft[i] += 1
            self.ttft_sum += seconds
            self.ttft_count += 1

    def finished(self, usage: dict, stats):
        with self.lock:
            self.prompt_tokens += usage["prompt_tokens"]
            self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            self.completion_tokens += usage["completion_tokens"]
            if stats is not None and stats.drafted:
                self.drafted += stats.drafted
                self.accepted += stats.accepted
                self.forwards += stats.target_forwards
                self.spec_generated += max(stats.generated - 1, 0)

    def render(self, queue_depth: int, cache: PromptCache | None) -> str:
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                out.append(f"{name}{labels} {v}")

        with self.lock:
            metric("mlxspec_requests_total", "counter", "HTTP requests by route and status.",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
            metric("mlxspec_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                   [("", self.prompt_tokens)])
            metric("mlxspec_prompt_cached_tokens_total", "counter", "Prompt tokens served from the prompt cache.",
                   [("", self.cached_tokens)])
            metric("mlxspec_completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)])
            metric("mlxspec_draft_tokens_total", "counter", "Draft tokens verified.", [("", self.drafted)])
            metric("mlxspec_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", self.accepted)])
            metric("mlxspec_acceptance_rate", "gauge", "Accepted / drafted since start.",
                   [("", self.accepted / self.drafted if self.drafted else 0.0)])
            metric("mlxspec_tau", "gauge", "Tokens committed per target forward since start (speculative requests).",
                   [("", self.spec_generated / self.forwards if self.forwards else 1.0)])
            metric("mlxspec_cancelled_total", "counter", "Generations cancelled (client gone or shutdown).",
                   [("", self.cancelled)])
            metric("mlxspec_timeouts_total", "counter", "Requests past their timeout.", [("", self.timeouts)])
            metric("mlxspec_queue_depth", "gauge", "Requests waiting or running.", [("", queue_depth)])
            if cache is not None:
                metric("mlxspec_prompt_cache_bytes", "gauge", "Bytes held by the prompt cache.", [("", cache.nbytes)])
                metric("mlxspec_prompt_cache_entries", "gauge", "Prompt cache entries.", [("", len(cache))])
            name = "mlxspec_time_to_first_token_seconds"
            out.append(f"# HELP {name} Time from arrival to the first generated token.")
            out.append(f"# TYPE {name} histogram")
            cum = 0
            for b, n in zip(TTFT_BUCKETS + (float("inf"),), self.ttft):
                cum += n
                le = "+Inf" if b == float("inf") else repr(b)
                out.append(f'{name}_bucket{{le="{le}"}} {cum}')
            out.append(f"{name}_sum {self.ttft_sum}")
            out.append(f"{name}_count {self.ttft_count}")
        return "\n".join(out) + "\n"


class Worker:
    def __init__(self, load_kwargs: dict, prompt_cache_bytes: int, max_queue: int, log=sys.stderr):
        self.load_kwargs = load_kwargs
        self.max_queue = max_queue
        self.log = log
        self.cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.metrics = Metrics()
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pending = 0  # waiting + running
        self.current: Job | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="mlxspec-generate", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self):
        """Load the model on the generation thread; raise the load error, if any."""
        self.thread.start()
        self.ready.wait()
        if self.load_error is not None:
            raise self.load_error

    def cancel_all(self):
        """Shutdown: refuse new jobs, cancel the running one and everything queued; each
        gets a 503 error event (a stream ends with an error chunk and [DONE])."""
        self.stopping = True
        with self.lock:
            cur = self.current
        jobs = [cur] if cur is not None else []
        while True:
            try:
                j = self.jobs.get_nowait()
            except queue.Empty:
                break
            if j is not None:
                jobs.append(j)
        for j in jobs:
            if not j.cancelled.is_set():
                j.cancel()
                j.post("error", 503, "server_shutting_down", "the server is shutting down; the request was cancelled")

    def stop(self, timeout: float = 10.0):
        self.cancel_all()
        self.jobs.put(None)
        self.thread.join(timeout)

    # -- admission -----------------------------------------------------------------------
    def try_submit(self, job: Job) -> bool:
        with self.lock:
            if self.stopping or self.pending >= self.max_queue:
                return False
            self.pending += 1
        self.jobs.put(job)
        return True

    @property
    def queue_depth(self) -> int:
        return self.pending

    # -- the thread ----------------------------------------------------------------------
    def _run(self):
        try:
            self.api = api
            self.target, self.tokenizer, self.spec = api.load(**self.load_kwargs)
            self.drafter = self.spec.make_drafter(self.target)
            self.need_taps = bool(tuple(self.drafter.taps))
            self.eos = api._eos_ids(self.tokenizer)
            self._warm_up()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                self.current = job
            try:
                self._serve(job)
            except BaseException as e:  # noqa: BLE001 - the thread must survive any job
                print(f"mlxspec serve: internal error in a generation:\n{traceback.format_exc()}", file=self.log)
                job.post("error", 500, "internal_error", f"internal error during generation ({type(e).__name__})")
            finally:
                with self.lock:
                    self.current = None
                    self.pending -= 1

    def _warm_up(self):
        """One tiny generation so the first request does not pay MLX's first-call costs."""
        ids = self.tokenizer.encode("Hello", add_special_tokens=False) or [0]
        for _ in self.api.stream_generate(self.target, self.tokenizer, ids, self.spec, max_tokens=2, drafter=self.drafter):
            pass

    def _serve(self, job: Job):
        if job.cancelled.is_set():
            self.metrics.cancelled += 1
            return
        if time.perf_counter() > job.deadline:
            self.metrics.timeouts += 1
            job.post("error", 504, "timeout", "the request timed out while waiting in the queue")
            return
        spec = self.spec if job.speculative else self.api.Speculator()
        inner = self.drafter if job.speculative else spec.make_drafter(self.target)
        need_taps = self.need_taps and job.speculative
        hit = self.cache.fetch(job.ids, need_taps) if (self.cache is not None and job.use_cache) else None
        n_cached = hit.n if hit else 0
        drafter = ContextDrafter(inner, job.ids[:n_cached], hit.taps if hit else None)
        cache = hit.cache if hit else self.target.make_cache()
        text, last, first, ok, toks = "", None, True, False, []
        gen = self.api.stream_generate(self.target, self.tokenizer, job.ids, spec, max_tokens=job.max_tokens, temp=job.temp,
                                       top_p=job.top_p, top_k=job.top_k, seed=job.seed, stop=job.stop, drafter=drafter, cache=cache)
        try:
            for r in gen:
                if first:
                    first = False
                    self.metrics.first_token(time.perf_counter() - job.submitted)
                last = r
                toks.append(r.token)
                text += r.text
                if job.cancelled.is_set():
                    self.metrics.cancelled += 1
                    break
                if time.perf_counter() > job.deadline and not r.finish_reason:
                    self.metrics.timeouts += 1
                    job.post("error", 504, "timeout", "the request timed out during generation")
                    break
                if text and (not r.from_draft or r.finish_reason):  # flush the step's token group
                    job.post("text", text)
                    text = ""
            ok = True
        finally:
            gen.close()
            if ok and self.cache is not None and job.use_cache:
                self.cache.store(drafter.tokens, cache, drafter.context_taps() if need_taps else None)
        if last is None or job.cancelled.is_set() or not last.finish_reason:
            return
        s = last.stats
        usage = {
            "prompt_tokens": len(job.ids),
            "completion_tokens": last.generation_tokens,
            "total_tokens": len(job.ids) + last.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": n_cached},
            "mlxspec": {
                "speculative": spec.description if job.speculative else "autoregressive",
                "drafted": s.drafted if s else 0,
                "accepted": s.accepted if s else 0,
                "acceptance_rate": s.acceptance_rate if s else 0.0,
                "tau": s.tau if s else 1.0,
                "target_forwards": s.target_forwards if s else 0,
                "draft_time_s": s.draft_time if s else 0.0,
                "verify_time_s": s.verify_time if s else 0.0,
                "prompt_time_s": s.prompt_time if s else 0.0,
                "generation_tps": last.generation_tps,
            },
        }
        self.metrics.finished(usage, s if job.speculative else None)
        if last.finish_reason == "stop" and job.stop and last.token not in self.eos:
            job.stop_sequence = _matched_stop(self.tokenizer.decode(toks), job.stop)
        job.post("done", last.finish_reason, usage)


def _matched_stop(full: str, stop: list[str]) -> str:
    """The stop string that ended a generation whose text (stop string included) is `full`:
    the occurrence that completes first, as `stream_generate` stops at it."""
    found = [(full.find(x) + len(x), i) for i, x in enumerate(stop) if x and x in full]
    return stop[min(found)[1]] if found else next((x for x in stop if x), None)
