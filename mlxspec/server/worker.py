"""The generation thread: one model, a running batch of generations, a bounded FIFO in front.

HTTP handlers (asyncio) submit `Job`s (`job.py`). With `max_batch` > 1 (continuous batching,
`batched.py`) the thread runs up to `max_batch` of them together in one `engine.batch.SpecBatch`.
With `max_batch` 1, or a target the batch cannot hold (sliding-window or recurrent layers: one
line says so at start), jobs run one at a time in arrival order through `api.stream_generate`
(`sequential.py`). Either way the thread posts events back into the job's event loop:

    ("text", str)                      text committed by one step (a token group)
    ("done", finish_reason, usage)     the end; usage as in the OpenAI response
    ("error", status, type, message)   the job failed (no traceback leaves the server)

A job stops within one step of `cancel()` (client gone, shutdown) or of its deadline.
All MLX work (loading included) happens on this thread. This module holds what both paths
share: loading, admission, the drafter pool, a job's drafter and cache, its usage.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import replace

from mlxspec import api
from mlxspec.engine.batch import SpecBatch, VerifyBudget
from mlxspec.engine.batch_rows import check_batchable
from mlxspec.engine.policy import PolicyMemory
from mlxspec.engine.suffix import SuffixIndex
from mlxspec.errors import MlxspecError
from mlxspec.server.batched import BatchedRun
from mlxspec.server.job import Job
from mlxspec.server.metrics import Metrics
from mlxspec.server.prompt_cache import ContextDrafter, PromptCache
from mlxspec.server.sequential import serve_one
from mlxspec.server import suffix_cache


def default_max_batch() -> int:
    """Sequences per batch when --max-batch is not given: on a CPU a verify of B x L rows stays
    cheaper than B verifies of L rows up to roughly a few dozen rows per core pair; 8 x the
    adaptive policy's typical 2..6 tokens fits that on 2+ cores (measured: docs/bench/serve_load.json)."""
    return 8 if (os.cpu_count() or 1) >= 2 else 4


class Arrival:
    """One request counted in `Worker.arriving` until it is submitted or fails (idempotent close)."""

    def __init__(self, worker: "Worker"):
        self.worker, self.open = worker, True

    def close(self):
        if self.open:
            self.open = False
            with self.worker.lock:
                self.worker.arriving -= 1


class Worker:
    def __init__(self, load_kwargs: dict, prompt_cache_bytes: int, max_queue: int, log=sys.stderr,
                 max_batch: int | None = None, share_keys: bool = False, suffix_cache: str | None = None,
                 suffix_cache_every: float = 60.0):
        self.load_kwargs = load_kwargs
        self.share_keys, self.suffix_cache = share_keys, suffix_cache
        # --suffix-cache-every: a save at most this often while finished requests are unsaved
        # (0: at shutdown only), made on this thread between steps, so a crash loses at most
        # that much of what the indexes learned
        self.suffix_cache_every, self.unsaved, self.saved_at = suffix_cache_every, 0, time.monotonic()
        self.tenants: dict[str, api.Speculator] = {}  # API key -> its view of the speculator
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
        if self.suffix_cache and self.ready.is_set() and self.load_error is None:
            self.save_suffix_cache()

    def save_suffix_cache(self) -> None:
        self.saved_at, unsaved = time.monotonic(), self.unsaved
        try:
            suffix_cache.save(self.suffix_cache, self, self.model_name)
        except OSError as e:  # retried after the interval; the server goes on
            print(f"mlxspec serve: --suffix-cache {self.suffix_cache}: not saved ({e})", file=self.log, flush=True)
            return
        with self.lock:
            self.unsaved -= unsaved

    def autosave_wait(self) -> float | None:
        """Seconds until a --suffix-cache save is due (0: now), None when none is."""
        if not self.suffix_cache or self.suffix_cache_every <= 0 or self.unsaved <= 0:
            return None
        return max(0.0, self.saved_at + self.suffix_cache_every - time.monotonic())

    def autosave(self) -> None:
        """The generation thread's periodic save (between jobs or steps, never during one)."""
        if self.autosave_wait() == 0.0:
            self.save_suffix_cache()

    def next_job(self):
        """The queue's next job (None: stop), waiting as long as it takes; a save that falls
        due while the server is idle is made then."""
        while True:
            self.autosave()
            try:
                return self.jobs.get(timeout=self.autosave_wait())
            except queue.Empty:
                continue

    @property
    def model_name(self) -> str:
        """What a suffix cache file is tied to: the target's file (or the model asked for)."""
        return str(self.target.info.source or self.load_kwargs.get("model") or "default")

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

    def done(self, job: Job):
        with self.lock:
            if job in self.running:
                self.running.remove(job)
            self.pending -= 1
            self.unsaved += job.speculative

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
                    if self.spec.tree.on:
                        print(f"mlxspec serve: --tree {self.spec.tree.mode if self.spec.tree.mode == 'auto' else self.spec.tree.nodes}: "
                              "batched serving verifies chains (the rows of one batched forward share one mask layout); "
                              "--max-batch 1 serves every request with trees",
                              file=self.log, flush=True)
                except MlxspecError as e:
                    print(f"mlxspec serve: --max-batch {self.max_batch}: {e}", file=self.log, flush=True)
            self.metrics.max_batch = self.max_batch if self.batch is not None else 1
            self.pool = [self.drafter]  # free drafters (their state is reset by `begin`)
            self.spec.use_shared(self.drafter, SuffixIndex(256))  # the warm-up's text joins no one's index
            self._warm_up()
            if self.suffix_cache:
                suffix_cache.restore(self.suffix_cache, self, self.model_name, self.log)
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        if self.batch is not None:
            BatchedRun(self).run()
            return
        while True:
            job = self.next_job()
            if job is None:
                return
            with self.lock:
                self.running.append(job)
            try:
                serve_one(self, job)
            except BaseException as e:  # noqa: BLE001 - the thread must survive any job
                print(f"mlxspec serve: internal error in a generation:\n{traceback.format_exc()}", file=self.log)
                job.post("error", 500, "internal_error", f"internal error during generation ({type(e).__name__})")
            finally:
                self.done(job)

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

    # -- one job, on either path -----------------------------------------------------------
    def check_expired(self, job: Job) -> bool:
        """Before a job starts: True (and the job answered) when it was cancelled or timed out."""
        if job.cancelled.is_set():
            self.metrics.cancelled += 1
            return True
        if time.perf_counter() > job.deadline:
            self.metrics.timeouts += 1
            job.post("error", 504, "timeout", "the request timed out while waiting in the queue")
            return True
        return False

    def tenant_spec(self, tenant: str | None) -> api.Speculator:
        """The speculator a key's jobs run with: the server's, with that key's own suffix index
        and policy memory (what earlier requests taught the adaptive policy), so that another
        key's text never changes how this key's requests are drafted; the server's own with
        --suffix-share-keys or without keys."""
        if tenant is None or self.share_keys:
            return self.spec
        if tenant not in self.tenants:
            budget = self.spec.suffix.budget if self.spec.suffix is not None else None
            self.tenants[tenant] = replace(self.spec, memory=PolicyMemory(),
                                           suffix=SuffixIndex(budget) if budget else None)
        return self.tenants[tenant]

    def suffix_indexes(self) -> list[SuffixIndex]:
        """Every suffix index the server holds (for /metrics)."""
        specs = list(self.tenants.values()) or [self.spec]
        return [s.suffix for s in specs if s.suffix is not None]

    def job_setup(self, job: Job):
        """The job's drafter (wrapped for the prompt cache), its target cache and the cached count."""
        spec = self.tenant_spec(job.tenant) if job.speculative else self.api.Speculator()
        if job.speculative:
            inner = self.pool.pop() if self.pool else self.spec.make_drafter(self.target)
            spec.use_shared(inner, spec.suffix)
        else:
            inner = spec.make_drafter(self.target)
        need_taps = self.need_taps and job.speculative
        hit = self.cache.fetch(job.ids, need_taps) if (self.cache is not None and job.use_cache) else None
        n_cached = hit.n if hit else 0
        drafter = ContextDrafter(inner, job.ids[:n_cached], hit.taps if hit else None)
        cache = hit.cache if hit else self.target.make_cache()
        return spec, inner, drafter, cache, n_cached

    def usage(self, job: Job, spec, n_cached: int, generated: int, s, tps: float) -> dict:
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

    def fail(self, job: Job, e: BaseException):
        """A job that raised: the traceback to the log, the client a 500 without it."""
        print(f"mlxspec serve: internal error in a generation:\n{traceback.format_exc()}", file=self.log)
        job.post("error", 500, "internal_error", f"internal error during generation ({type(e).__name__})")
        self.done(job)
