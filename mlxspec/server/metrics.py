"""The server's counters and gauges (`Metrics`), rendered as Prometheus text for /metrics."""

from __future__ import annotations

import collections
import threading
import time

from mlxspec.blas import blas_threads
from mlxspec.server.prompt_cache import PromptCache

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW = 10.0  # seconds of committed tokens behind the aggregate tok/s gauge


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

    def render(self, queue_depth: int, cache: PromptCache | None, suffix=()) -> str:
        """suffix: the server's suffix indexes (`Worker.suffix_indexes`)."""
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
            if suffix:
                metric("mlxspec_suffix_indexes", "gauge", "Suffix indexes of earlier outputs (--lookup suffix: one per "
                       "API key, or one shared).", [("", len(suffix))])
                metric("mlxspec_suffix_index_tokens", "gauge", "Tokens held by all suffix indexes.",
                       [("", sum(len(s) for s in suffix))])
                metric("mlxspec_suffix_index_max_tokens", "gauge", "Tokens held by the fullest suffix index.",
                       [("", max(len(s) for s in suffix))])
                metric("mlxspec_suffix_index_budget_tokens", "gauge", "Each suffix index's budget (least recently "
                       "used outputs dropped beyond it).", [("", suffix[0].budget or 0)])
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
