"""The generation thread: one model, a running batch of generations, a bounded FIFO in front.

HTTP handlers (asyncio) submit `Job`s. With `max_batch` > 1 (continuous batching) the thread
runs up to `max_batch` of them together in one `engine.batch.SpecBatch`: jobs join at a step
boundary (the waiting ones' prompts prefilled together, each from its prompt-cache hit), every step drafts for each
job with its own drafter and verifies all of them in one target forward, and a job leaves as
soon as it is finished, cancelled or past its deadline. With `max_batch` 1, or a target the
batch cannot hold (sliding-window or recurrent layers: one line says so at start), jobs run
one at a time in arrival order through `api.stream_generate`, as before. Either way the
thread posts events back into the job's event loop:

    ("text", str)                      text committed by one step (a token group)
    ("done", finish_reason, usage)     the end; usage as in the OpenAI response
    ("error", status, type, message)   the job failed (no traceback leaves the server)

A job stops within one step of `cancel()` (client gone, shutdown) or of its deadline.
All MLX work (loading included) happens on this thread.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from mlxspec import api
from mlxspec.blas import blas_threads
from mlxspec.engine.batch import SpecBatch, VerifyBudget, check_batchable
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.server.prompt_cache import ContextDrafter, PromptCache
from mlxspec.validate import check_prompt_ids, check_sampling_args

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW = 10.0  # seconds of committed tokens behind the aggregate tok/s gauge
# How long an idle worker holds the first job of a burst: ARRIVAL_MIN always (the event loop
# accepts the burst's other connections meanwhile), up to ARRIVAL_WAIT while requests are still
# being read and tokenised. Measured: 8 clients at once were otherwise prefilled as 1 + 7 or
# 5 + 3, the later ones waiting for the first prefill; a lone request pays ARRIVAL_MIN.
ARRIVAL_MIN = 0.01
ARRIVAL_WAIT = 0.05


def default_max_batch() -> int:
    """Sequences per batch when --max-batch is not given: on a CPU a verify of B x L rows stays
    cheaper than B verifies of L rows up to roughly a few dozen rows per core pair; 8 x the
    adaptive policy's typical 2..6 tokens fits that on 2+ cores (measured: docs/bench/serve_load.json)."""
    return 8 if (os.cpu_count() or 1) >= 2 else 4


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
        self.batch_size, self.max_batch, self.batch_steps, self.steps_ahead = 0, 1, 0, 0
        self.prefills = self.prefilled_rows = 0  # prefill forwards, and the prompts they ran
        self.recent: collections.deque = collections.deque()  # (time, tokens committed) of the last RATE_WINDOW s
        self.started = time.perf_counter()

    def committed(self, n: int):
        """Tokens committed to some request (a step's, or a first token): the aggregate rate."""
        now = time.perf_counter()
        with self.lock:
            self.recent.append((now, n))
            while self.recent and self.recent[0][0] < now - RATE_WINDOW:
                self.recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        with self.lock:
            while self.recent and self.recent[0][0] < now - RATE_WINDOW:
                self.recent.popleft()
            n = sum(k for _, k in self.recent)
        return n / min(RATE_WINDOW, max(now - self.started, 1e-9))

    def request(self, route: str, status: int):
        with self.lock:
            k = (route, status)
            self.requests[k] = self.requests.get(k, 0) + 1

    def prefilled(self, rows: int):
        """One prefill forward over `rows` prompts (a burst of arrivals joins in one)."""
        with self.lock:
            self.prefills += 1
            self.prefilled_rows += rows

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
        tps = self.tokens_per_second()

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
            metric("mlxspec_batch_size", "gauge", "Requests in the running batch now.", [("", self.batch_size)])
            metric("mlxspec_max_batch", "gauge", "Most requests run together (--max-batch; 1: one at a time).",
                   [("", self.max_batch)])
            metric("mlxspec_batch_steps_total", "counter", "Batched speculative steps (one target verify each).",
                   [("", self.batch_steps)])
            metric("mlxspec_batch_steps_started_ahead_total", "counter", "Autoregressive batched steps whose forward "
                   "the step before started (overlapping its bookkeeping and streaming).", [("", self.steps_ahead)])
            metric("mlxspec_prefills_total", "counter", "Prefill forwards (several arriving prompts share one).",
                   [("", self.prefills)])
            metric("mlxspec_prefilled_prompts_total", "counter", "Prompts prefilled (by those forwards).",
                   [("", self.prefilled_rows)])
            threads = blas_threads()
            if threads is not None:
                metric("mlxspec_blas_threads", "gauge", "OpenBLAS threads in use now (the governor follows the "
                       "host's load; MLXSPEC_BLAS_THREADS fixes it).", [("", threads)])
            metric("mlxspec_generation_tokens_per_second", "gauge",
                   f"Tokens generated per second over all requests, over the last {RATE_WINDOW:g} s.", [("", tps)])
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


class TextStream:
    """One request's committed tokens -> the text to send, as `api.stream_generate` makes it
    (detokenizer, EOS and max_tokens, stop strings with the tail that may start one held
    back), pushed a step's tokens at a time instead of pulled from the engine."""

    def __init__(self, tokenizer, eos: set, max_tokens: int, stop: list[str]):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos, self.max_tokens = eos, max_tokens
        self.stop = [x for x in stop if x]
        self.text_so_far, self.sent, self.emitted = "", 0, 0
        self.tokens: list[int] = []
        self.finish: str | None = None

    def feed(self, committed: list[int]) -> str:
        """The text of one step's tokens (stops at the first finish; `finish` tells why)."""
        out = ""
        for tok in committed:
            self.emitted += 1
            self.tokens.append(tok)
            finish = "stop" if tok in self.eos else ("length" if self.emitted >= self.max_tokens else None)
            if tok not in self.eos:
                self.detok.add_token(tok)
            if finish:
                self.detok.finalize()
            seg = self.detok.last_segment
            if self.stop:
                self.text_so_far += seg
                hit = min((self.text_so_far.find(x) for x in self.stop if x in self.text_so_far), default=-1)
                if hit >= 0:
                    finish, end = "stop", hit
                elif finish:
                    end = len(self.text_so_far)
                else:
                    end = len(self.text_so_far) - max(
                        (k for x in self.stop for k in range(1, len(x)) if self.text_so_far.endswith(x[:k])), default=0)
                seg = self.text_so_far[self.sent:end]
                self.sent += len(seg)
            out += seg
            if finish:
                self.finish = finish
                break
        return out


class Arrival:
    """One request counted in `Worker.arriving` until it is submitted or fails (idempotent close)."""

    def __init__(self, worker: "Worker"):
        self.worker, self.open = worker, True

    def close(self):
        if self.open:
            self.open = False
            with self.worker.lock:
                self.worker.arriving -= 1


@dataclass(eq=False)
class _Live:
    """A job in the running batch."""

    job: Job
    row: object  # engine.batch.Row
    drafter: ContextDrafter
    text: TextStream
    n_cached: int
    spec: api.Speculator
    pooled: object  # the drafter borrowed from the pool (returned when the job leaves), or None


class Worker:
    def __init__(self, load_kwargs: dict, prompt_cache_bytes: int, max_queue: int, log=sys.stderr,
                 max_batch: int | None = None):
        self.load_kwargs = load_kwargs
        self.max_queue = max_queue
        self.max_batch = default_max_batch() if max_batch is None else max_batch
        self.log = log
        self.cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.metrics = Metrics()
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pending = 0  # waiting + running
        self.arriving = 0  # requests the HTTP side is still reading/tokenising (not submitted yet)
        self.running: list[Job] = []
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.stopping = False
        self.batch: SpecBatch | None = None
        self.thread = threading.Thread(target=self._run, name="mlxspec-generate", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self):
        """Load the model on the generation thread; raise the load error, if any."""
        self.thread.start()
        self.ready.wait()
        if self.load_error is not None:
            raise self.load_error

    def cancel_all(self):
        """Shutdown: refuse new jobs, cancel the running ones and everything queued; each
        gets a 503 error event (a stream ends with an error chunk and [DONE])."""
        self.stopping = True
        with self.lock:
            jobs = list(self.running)
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

    def arrival(self) -> "Arrival":
        """A request on its way in (counted until `Arrival.close`): an idle worker woken by a
        burst waits briefly for the rest of it, so the burst is prefilled in one forward."""
        with self.lock:
            self.arriving += 1
        return Arrival(self)

    @property
    def queue_depth(self) -> int:
        return self.pending

    def _done(self, job: Job):
        with self.lock:
            if job in self.running:
                self.running.remove(job)
            self.pending -= 1

    # -- the thread ----------------------------------------------------------------------
    def _run(self):
        try:
            self.api = api
            self.target, self.tokenizer, self.spec = api.load(**self.load_kwargs)
            self.drafter = self.spec.make_drafter(self.target)
            self.need_taps = bool(tuple(self.drafter.taps))
            self.eos = api._eos_ids(self.tokenizer)
            if self.max_batch > 1:
                try:
                    check_batchable(self.target)
                    budget = None
                    if self.drafter.max_drafts > 0:  # drafts per row priced by the batch's measured costs
                        budget = VerifyBudget(api.profile_for(self.target, self.drafter), self.drafter.max_drafts)
                    self.batch = SpecBatch(self.target, taps=tuple(self.drafter.taps), budget=budget)
                except MlxspecError as e:
                    print(f"mlxspec serve: --max-batch {self.max_batch}: {e}", file=self.log, flush=True)
            self.metrics.max_batch = self.max_batch if self.batch is not None else 1
            self.pool = [self.drafter]  # free drafters (their state is reset by `begin`)
            self._warm_up()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        if self.batch is not None:
            self._run_batched()
            return
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                self.running.append(job)
            try:
                self._serve(job)
            except BaseException as e:  # noqa: BLE001 - the thread must survive any job
                print(f"mlxspec serve: internal error in a generation:\n{traceback.format_exc()}", file=self.log)
                job.post("error", 500, "internal_error", f"internal error during generation ({type(e).__name__})")
            finally:
                self._done(job)

    def _warm_up(self):
        """One tiny generation so the first request does not pay MLX's first-call costs."""
        ids = self.tokenizer.encode("Hello", add_special_tokens=False) or [0]
        for _ in self.api.stream_generate(self.target, self.tokenizer, ids, self.spec, max_tokens=2, drafter=self.drafter):
            pass
        if self.batch is not None:  # and one batched step of two rows (the batch's own shapes)
            second = self.spec.make_drafter(self.target)
            for d in (self.drafter, second):
                self.batch.add(ids, drafter=d, max_tokens=3)
            self.batch.step()
            self.batch.remove(list(self.batch.rows))
            self.pool.append(second)

    def _check_expired(self, job: Job) -> bool:
        """Before a job starts: True (and the job answered) when it was cancelled or timed out."""
        if job.cancelled.is_set():
            self.metrics.cancelled += 1
            return True
        if time.perf_counter() > job.deadline:
            self.metrics.timeouts += 1
            job.post("error", 504, "timeout", "the request timed out while waiting in the queue")
            return True
        return False

    def _start(self, job: Job):
        """The job's drafter (wrapped for the prompt cache), its target cache and the cached count."""
        spec = self.spec if job.speculative else self.api.Speculator()
        if job.speculative:
            inner = self.pool.pop() if self.pool else self.spec.make_drafter(self.target)
        else:
            inner = spec.make_drafter(self.target)
        need_taps = self.need_taps and job.speculative
        hit = self.cache.fetch(job.ids, need_taps) if (self.cache is not None and job.use_cache) else None
        n_cached = hit.n if hit else 0
        drafter = ContextDrafter(inner, job.ids[:n_cached], hit.taps if hit else None)
        cache = hit.cache if hit else self.target.make_cache()
        return spec, inner, drafter, cache, n_cached

    def _usage(self, job: Job, spec, n_cached: int, generated: int, s, tps: float) -> dict:
        return {
            "prompt_tokens": len(job.ids),
            "completion_tokens": generated,
            "total_tokens": len(job.ids) + generated,
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
                "generation_tps": tps,
            },
        }

    # -- one at a time (--max-batch 1, or a target the batch cannot hold) -----------------
    def _serve(self, job: Job):
        if self._check_expired(job):
            return
        spec, inner, drafter, cache, n_cached = self._start(job)
        if job.speculative:
            self.pool.append(inner)
        need_taps = self.need_taps and job.speculative
        text, last, first, ok, toks = "", None, True, False, []
        gen = self.api.stream_generate(self.target, self.tokenizer, job.ids, spec, max_tokens=job.max_tokens, temp=job.temp,
                                       top_p=job.top_p, top_k=job.top_k, seed=job.seed, stop=job.stop, drafter=drafter, cache=cache)
        try:
            for r in gen:
                if first:
                    first = False
                    self.metrics.prefilled(1)
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
                self.metrics.committed(1)
            ok = True
        finally:
            gen.close()
            if ok and self.cache is not None and job.use_cache:
                self.cache.store(drafter.tokens, cache, drafter.context_taps() if need_taps else None)
        if last is None or job.cancelled.is_set() or not last.finish_reason:
            return
        usage = self._usage(job, spec, n_cached, last.generation_tokens, last.stats, last.generation_tps)
        self.metrics.finished(usage, last.stats if job.speculative else None)
        if last.finish_reason == "stop" and job.stop and last.token not in self.eos:
            job.stop_sequence = _matched_stop(self.tokenizer.decode(toks), job.stop)
        job.post("done", last.finish_reason, usage)

    # -- continuous batching --------------------------------------------------------------
    def _run_batched(self):
        live: dict[int, _Live] = {}  # id(row) -> the job's state
        while True:
            # 1. admit: wait for work when idle, else take what is queued, up to max_batch; the
            # new jobs' prompts are prefilled together (`SpecBatch.add_many`)
            new, stop = [], False
            idle, woke = not live, 0.0
            while len(live) + len(new) < self.max_batch:
                try:
                    if not new and idle:
                        job = self.jobs.get()
                        woke = time.perf_counter()
                    elif idle:  # woken by a job: give a burst's other requests a moment to arrive
                        left = woke + (ARRIVAL_WAIT if self.arriving > 0 else ARRIVAL_MIN) - time.perf_counter()
                        if left <= 0:
                            break
                        job = self.jobs.get(timeout=left)
                    else:
                        job = self.jobs.get(block=False)
                except queue.Empty:
                    if idle and self.arriving > 0 and time.perf_counter() < woke + ARRIVAL_WAIT:
                        continue
                    break
                if job is None:
                    stop = True
                    break
                with self.lock:
                    self.running.append(job)
                new.append(job)
            self._join_all(live, new)
            if stop:
                for lv in list(live.values()):
                    self._leave(live, lv, store=False)
                return
            self.metrics.batch_size = len(live)
            if not live:
                continue
            # 2. one batched step over every job
            ahead = self.batch.pipelined
            try:
                results = self.batch.step()
            except BaseException as e:  # noqa: BLE001 - a failed step fails every job in it
                for lv in list(live.values()):
                    self._fail(lv.job, e)
                    self._release(lv)
                live.clear()
                self.batch = SpecBatch(self.target, taps=self.batch.taps, budget=self.batch.budget)
                continue
            self.metrics.batch_steps += 1
            self.metrics.steps_ahead += self.batch.pipelined - ahead
            n = 0
            for row, committed in results:
                lv = live[id(row)]
                text = lv.text.feed(committed)
                n += len(committed)
                if text:
                    lv.job.post("text", text)
                if lv.text.finish:
                    row.done = True
            self.metrics.committed(n)
            # 3. leave: finished, cancelled, past the deadline
            for lv in list(live.values()):
                self._after_step(live, lv)
            self.metrics.batch_size = len(live)

    def _join_all(self, live: dict, jobs: list):
        """Join new jobs: one alone through `SpecBatch.add` (it continues the job's cache, which the
        prompt cache can keep if the job is done at its first token), several prefilled together
        in one forward (`SpecBatch.add_many`), each from its cached prompt prefix if it has one."""
        preps = []
        for job in jobs:
            try:
                prep = self._prepare(job)
            except BaseException as e:  # noqa: BLE001 - the thread must survive any job
                self._fail(job, e)
                continue
            if prep is not None:
                preps.append(prep)
        if len(preps) == 1:
            p = preps[0]
            try:
                row, first = self.batch.add(**self._request(p), cache=p["cache"])
            except BaseException as e:  # noqa: BLE001
                self._abandon(p, e)
                return
            self.metrics.prefilled(1)
            self._joined_or_fail(live, p, row, first, p["cache"])
            return
        if not preps:
            return
        try:
            results = self.batch.add_many([dict(self._request(p), cache=p["cache"] if p["n_cached"] else None)
                                           for p in preps])
        except BaseException as e:  # noqa: BLE001 - a failed prefill fails every job in it
            for p in preps:
                self._abandon(p, e)
            return
        self.metrics.prefilled(len(preps))
        for p, (row, first) in zip(preps, results):
            # a row done at its first token never joined: its prompt is not stored (no cache of its own)
            self._joined_or_fail(live, p, row, first, None)

    def _joined_or_fail(self, live: dict, p: dict, row, first: list, cache):
        try:
            self._joined(live, p, row, first, cache)
        except BaseException as e:  # noqa: BLE001 - the thread must survive any job
            self._fail(p["job"], e)

    def _abandon(self, p: dict, e: BaseException):
        """A prepared job whose join failed: its pooled drafter back, the job answered 500."""
        if p["pooled"] is not None:
            self.pool.append(p["pooled"])
        self._fail(p["job"], e)

    def _prepare(self, job: Job) -> dict | None:
        """Check a new job and give it a drafter and a cache -> its state, or None (answered)."""
        if self._check_expired(job):
            self._done(job)
            return None
        try:
            check_sampling_args(job.max_tokens, job.temp, job.top_p, job.top_k, job.seed)
            ids = check_prompt_ids(job.ids, self.target.info.vocab_size,
                                   self.target.config.get("max_position_embeddings"), job.max_tokens)
        except MlxspecError as e:
            job.post("error", 400, "invalid_request_error", str(e))
            self._done(job)
            return None
        spec, inner, drafter, cache, n_cached = self._start(job)
        try:
            policy = api.make_policy(self.target, drafter, spec, job.temp)  # the whole length policy
        except BaseException:
            if job.speculative:
                self.pool.append(inner)
            raise
        return {"job": job, "ids": ids, "spec": spec, "drafter": drafter, "cache": cache, "n_cached": n_cached,
                "pooled": inner if job.speculative else None, "policy": policy,
                "sampling": SamplingParams(job.temp, job.top_p, job.top_k)}

    def _request(self, p: dict) -> dict:
        job = p["job"]
        return dict(prompt_ids=p["ids"], drafter=p["drafter"], max_tokens=job.max_tokens, sampling=p["sampling"],
                    seed=job.seed, eos_ids=self.eos, policy=p["policy"], tag=job)

    def _joined(self, live: dict, p: dict, row, first: list, cache):
        job = p["job"]
        self.metrics.first_token(time.perf_counter() - job.submitted)
        self.metrics.committed(1)
        lv = _Live(job, row, p["drafter"], TextStream(self.tokenizer, self.eos, job.max_tokens, job.stop),
                   p["n_cached"], p["spec"], p["pooled"])
        text = lv.text.feed(first)
        if text:
            job.post("text", text)
        if lv.text.finish or row.done:
            # done after its first token (EOS, max_tokens 1: it never joined the batch; a stop
            # string: it did, and leaves now)
            if not row.done:
                self.batch.remove([row])
            self._finish(lv, cache)
            return
        live[id(row)] = lv

    def _after_step(self, live: dict, lv: _Live):
        job = lv.job
        if job.cancelled.is_set():
            self.metrics.cancelled += 1
            self._leave(live, lv, store=True)
            return
        if lv.text.finish or lv.row.done:
            self._leave(live, lv, store=False, finish=True)
            return
        if time.perf_counter() > job.deadline:
            self.metrics.timeouts += 1
            job.post("error", 504, "timeout", "the request timed out during generation")
            self._leave(live, lv, store=True)

    def _leave(self, live: dict, lv: _Live, store: bool, finish: bool = False):
        row = lv.row
        cache = self.batch.extract(row) if (store or finish) and self.cache is not None and lv.job.use_cache else None
        self.batch.remove([row])
        del live[id(row)]
        if finish:
            self._finish(lv, cache)
            return
        if cache is not None:
            self._store(lv, cache)
        self._release(lv)
        self._done(lv.job)

    def _store(self, lv: _Live, cache):
        need_taps = self.need_taps and lv.job.speculative
        self.cache.store(lv.drafter.tokens, cache, lv.drafter.context_taps() if need_taps else None)

    def _finish(self, lv: _Live, cache):
        """Answer a finished job (its usage, the stop string that ended it) and let it go."""
        job, s = lv.job, lv.row.stats
        if cache is not None and self.cache is not None and job.use_cache:
            self._store(lv, cache)
        self._release(lv)
        usage = self._usage(job, lv.spec, lv.n_cached, lv.text.emitted, s, s.generation_tps)
        self.metrics.finished(usage, s if job.speculative else None)
        if lv.text.finish == "stop" and job.stop and lv.text.tokens[-1] not in self.eos:
            job.stop_sequence = _matched_stop(self.tokenizer.decode(lv.text.tokens), job.stop)
        job.post("done", lv.text.finish or "length", usage)
        self._done(job)

    def _release(self, lv: _Live):
        if lv.pooled is not None:
            self.pool.append(lv.pooled)
            lv.pooled = None

    def _fail(self, job: Job, e: BaseException):
        print(f"mlxspec serve: internal error in a generation:\n{traceback.format_exc()}", file=self.log)
        job.post("error", 500, "internal_error", f"internal error during generation ({type(e).__name__})")
        self._done(job)


def _matched_stop(full: str, stop: list[str]) -> str:
    """The stop string that ended a generation whose text (stop string included) is `full`:
    the occurrence that completes first, as `stream_generate` stops at it."""
    found = [(full.find(x) + len(x), i) for i, x in enumerate(stop) if x and x in full]
    return stop[min(found)[1]] if found else next((x for x in stop if x), None)
