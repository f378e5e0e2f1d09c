"""Continuous batching (`--max-batch` > 1): up to `max_batch` jobs run together in the worker's
one `engine.batch.SpecBatch`. Jobs join at a step boundary (the waiting ones' prompts prefilled
together, each from its prompt-cache hit), every step drafts for each job with its own drafter
and verifies all of them in one target forward, and a job leaves as soon as it is finished,
cancelled or past its deadline."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from mlxspec import api
from mlxspec.engine.batch import SpecBatch
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.server.job import Job
from mlxspec.server.prompt_cache import ContextDrafter
from mlxspec.server.text import TextStream, matched_stop
from mlxspec.validate import check_prompt_ids, check_sampling_args

# How long an idle worker holds the first job of a burst: ARRIVAL_MIN always (the event loop
# accepts the burst's other connections meanwhile), up to ARRIVAL_WAIT while requests are still
# being read and tokenised. Measured: 8 clients at once were otherwise prefilled as 1 + 7 or
# 5 + 3, the later ones waiting for the first prefill; a lone request pays ARRIVAL_MIN.
ARRIVAL_MIN = 0.01
ARRIVAL_WAIT = 0.05


@dataclass(eq=False)
class Live:
    """A job in the running batch."""

    job: Job
    row: object  # engine.batch_rows.Row
    drafter: ContextDrafter
    text: TextStream
    n_cached: int
    spec: api.Speculator
    pooled: object  # the drafter borrowed from the pool (returned when the job leaves), or None


class BatchedRun:
    """The worker's thread while it batches: admit, step, leave, until the stop sentinel."""

    def __init__(self, w):
        self.w = w  # the `worker.Worker`: its queue, batch, drafter pool, prompt cache and metrics
        self.live: dict[int, Live] = {}  # id(row) -> the job's state

    def run(self):
        w, live = self.w, self.live
        while True:
            w.autosave()  # --suffix-cache, when due (a time check otherwise)
            # 1. admit: wait for work when idle, else take what is queued, up to max_batch; the
            # new jobs' prompts are prefilled together (`SpecBatch.add_many`)
            new, stop = [], False
            idle, woke = not live, 0.0
            while len(live) + len(new) < w.max_batch:
                try:
                    if not new and idle:
                        job = w.next_job()
                        woke = time.perf_counter()
                    elif idle:  # woken by a job: give a burst's other requests a moment to arrive
                        left = woke + (ARRIVAL_WAIT if w.arriving > 0 else ARRIVAL_MIN) - time.perf_counter()
                        if left <= 0:
                            break
                        job = w.jobs.get(timeout=left)
                    else:
                        job = w.jobs.get(block=False)
                except queue.Empty:
                    if idle and w.arriving > 0 and time.perf_counter() < woke + ARRIVAL_WAIT:
                        continue
                    break
                if job is None:
                    stop = True
                    break
                with w.lock:
                    w.running.append(job)
                new.append(job)
            self._join_all(new)
            if stop:
                for lv in list(live.values()):
                    self._leave(lv, store=False)
                return
            w.metrics.batch_size = len(live)
            if not live:
                continue
            # 2. one batched step over every job
            ahead = w.batch.pipelined
            try:
                results = w.batch.step()
            except BaseException as e:  # noqa: BLE001 - a failed step fails every job in it
                for lv in list(live.values()):
                    w.fail(lv.job, e)
                    self._release(lv)
                live.clear()
                w.batch = SpecBatch(w.target, taps=w.batch.taps, budget=w.batch.budget)
                continue
            w.metrics.batch_steps += 1
            w.metrics.steps_ahead += w.batch.pipelined - ahead
            n = 0
            for row, committed in results:
                lv = live[id(row)]
                text = lv.text.feed(committed)
                n += len(committed)
                if text:
                    lv.job.post("text", text)
                if lv.text.finish:
                    row.done = True
            w.metrics.committed(n)
            # 3. leave: finished, cancelled, past the deadline
            for lv in list(live.values()):
                self._after_step(lv)
            w.metrics.batch_size = len(live)

    def _join_all(self, jobs: list):
        """Join new jobs: one alone through `SpecBatch.add` (it continues the job's cache, which the
        prompt cache can keep if the job is done at its first token), several prefilled together
        in one forward (`SpecBatch.add_many`), each from its cached prompt prefix if it has one."""
        w = self.w
        preps = []
        for job in jobs:
            try:
                prep = self._prepare(job)
            except BaseException as e:  # noqa: BLE001 - the thread must survive any job
                w.fail(job, e)
                continue
            if prep is not None:
                preps.append(prep)
        if len(preps) == 1:
            p = preps[0]
            try:
                row, first = w.batch.add(**self._request(p), cache=p["cache"])
            except BaseException as e:  # noqa: BLE001
                self._abandon(p, e)
                return
            w.metrics.prefilled(1)
            self._joined_or_fail(p, row, first, p["cache"])
            return
        if not preps:
            return
        try:
            results = w.batch.add_many([dict(self._request(p), cache=p["cache"] if p["n_cached"] else None)
                                        for p in preps])
        except BaseException as e:  # noqa: BLE001 - a failed prefill fails every job in it
            for p in preps:
                self._abandon(p, e)
            return
        w.metrics.prefilled(len(preps))
        for p, (row, first) in zip(preps, results):
            # a row done at its first token never joined: its prompt is not stored (no cache of its own)
            self._joined_or_fail(p, row, first, None)

    def _joined_or_fail(self, p: dict, row, first: list, cache):
        try:
            self._joined(p, row, first, cache)
        except BaseException as e:  # noqa: BLE001 - the thread must survive any job
            self.w.fail(p["job"], e)

    def _abandon(self, p: dict, e: BaseException):
        """A prepared job whose join failed: its pooled drafter back, the job answered 500."""
        if p["pooled"] is not None:
            self.w.pool.append(p["pooled"])
        self.w.fail(p["job"], e)

    def _prepare(self, job: Job) -> dict | None:
        """Check a new job and give it a drafter and a cache -> its state, or None (answered)."""
        w = self.w
        if w.check_expired(job):
            w.done(job)
            return None
        try:
            check_sampling_args(job.max_tokens, job.temp, job.top_p, job.top_k, job.seed)
            ids = check_prompt_ids(job.ids, w.target.info.vocab_size,
                                   w.target.config.get("max_position_embeddings"), job.max_tokens)
        except MlxspecError as e:
            job.post("error", 400, "invalid_request_error", str(e))
            w.done(job)
            return None
        spec, inner, drafter, cache, n_cached = w.job_setup(job)
        try:
            policy = api.make_policy(w.target, drafter, spec, job.temp)  # the whole length policy
        except BaseException:
            if job.speculative:
                w.pool.append(inner)
            raise
        return {"job": job, "ids": ids, "spec": spec, "drafter": drafter, "cache": cache, "n_cached": n_cached,
                "pooled": inner if job.speculative else None, "policy": policy,
                "sampling": SamplingParams(job.temp, job.top_p, job.top_k)}

    def _request(self, p: dict) -> dict:
        job = p["job"]
        return dict(prompt_ids=p["ids"], drafter=p["drafter"], max_tokens=job.max_tokens, sampling=p["sampling"],
                    seed=job.seed, eos_ids=self.w.eos, policy=p["policy"], tag=job)

    def _joined(self, p: dict, row, first: list, cache):
        w, job = self.w, p["job"]
        w.metrics.first_token(time.perf_counter() - job.submitted)
        w.metrics.committed(1)
        lv = Live(job, row, p["drafter"], TextStream(w.tokenizer, w.eos, job.max_tokens, job.stop),
                  p["n_cached"], p["spec"], p["pooled"])
        text = lv.text.feed(first)
        if text:
            job.post("text", text)
        if lv.text.finish or row.done:
            # done after its first token (EOS, max_tokens 1: it never joined the batch; a stop
            # string: it did, and leaves now)
            if not row.done:
                w.batch.remove([row])
            self._finish(lv, cache)
            return
        self.live[id(row)] = lv

    def _after_step(self, lv: Live):
        w, job = self.w, lv.job
        if job.cancelled.is_set():
            w.metrics.cancelled += 1
            self._leave(lv, store=True)
            return
        if lv.text.finish or lv.row.done:
            self._leave(lv, store=False, finish=True)
            return
        if time.perf_counter() > job.deadline:
            w.metrics.timeouts += 1
            job.post("error", 504, "timeout", "the request timed out during generation")
            self._leave(lv, store=True)

    def _leave(self, lv: Live, store: bool, finish: bool = False):
        w, row = self.w, lv.row
        cache = w.batch.extract(row) if (store or finish) and w.cache is not None and lv.job.use_cache else None
        w.batch.remove([row])
        del self.live[id(row)]
        if finish:
            self._finish(lv, cache)
            return
        if cache is not None:
            self._store(lv, cache)
        self._release(lv)
        w.done(lv.job)

    def _store(self, lv: Live, cache):
        need_taps = self.w.need_taps and lv.job.speculative
        self.w.cache.store(lv.drafter.tokens, cache, lv.drafter.context_taps() if need_taps else None)

    def _finish(self, lv: Live, cache):
        """Answer a finished job (its usage, the stop string that ended it) and let it go."""
        w, job, s = self.w, lv.job, lv.row.stats
        if cache is not None and w.cache is not None and job.use_cache:
            self._store(lv, cache)
        self._release(lv)
        usage = w.usage(job, lv.spec, lv.n_cached, lv.text.emitted, s, s.generation_tps)
        w.metrics.finished(usage, s if job.speculative else None)
        if lv.text.finish == "stop" and job.stop and lv.text.tokens[-1] not in w.eos:
            job.stop_sequence = matched_stop(w.tokenizer.decode(lv.text.tokens), job.stop)
        job.post("done", lv.text.finish or "length", usage)
        w.done(job)

    def _release(self, lv: Live):
        if lv.pooled is not None:
            self.w.pool.append(lv.pooled)
            lv.pooled = None
