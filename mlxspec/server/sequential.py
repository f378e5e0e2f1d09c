"""One generation at a time (`--max-batch 1`, or a target the batch cannot hold): the job runs
alone through `api.stream_generate`, its text posted a step's token group at a time."""

from __future__ import annotations

import time

from mlxspec.server.job import Job
from mlxspec.server.text import matched_stop


def serve_one(w, job: Job):
    """Run `job` to its end on the worker `w` (a `worker.Worker`: its model, drafter pool,
    prompt cache and metrics) and post its events."""
    if w.check_expired(job):
        return
    spec, inner, drafter, cache, n_cached = w.job_setup(job)
    if job.speculative:
        w.pool.append(inner)
    need_taps = w.need_taps and job.speculative
    text, last, first, ok, toks = "", None, True, False, []
    gen = w.api.stream_generate(w.target, w.tokenizer, job.ids, spec, max_tokens=job.max_tokens, temp=job.temp,
                                top_p=job.top_p, top_k=job.top_k, seed=job.seed, stop=job.stop, drafter=drafter, cache=cache)
    try:
        for r in gen:
            if first:
                first = False
                w.metrics.prefilled(1)
                w.metrics.first_token(time.perf_counter() - job.submitted)
            last = r
            toks.append(r.token)
            text += r.text
            if job.cancelled.is_set():
                w.metrics.cancelled += 1
                break
            if time.perf_counter() > job.deadline and not r.finish_reason:
                w.metrics.timeouts += 1
                job.post("error", 504, "timeout", "the request timed out during generation")
                break
            if text and (not r.from_draft or r.finish_reason):  # flush the step's token group
                job.post("text", text)
                text = ""
            w.metrics.committed(1)
        ok = True
    finally:
        gen.close()
        if ok and w.cache is not None and job.use_cache:
            w.cache.store(drafter.tokens, cache, drafter.context_taps() if need_taps else None)
    if last is None or job.cancelled.is_set() or not last.finish_reason:
        return
    usage = w.usage(job, spec, n_cached, last.generation_tokens, last.stats, last.generation_tps)
    w.metrics.finished(usage, last.stats if job.speculative else None)
    if last.finish_reason == "stop" and job.stop and last.token not in w.eos:
        job.stop_sequence = matched_stop(w.tokenizer.decode(toks), job.stop)
    job.post("done", last.finish_reason, usage)
