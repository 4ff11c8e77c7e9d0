"""Prometheus metrics of one worker, on its own registry, served over HTTP when a port is set.

Job counters are updated where things happen (thread-safe). Engine figures are a snapshot
the step loop takes every ``STATS_EVERY_S``; the collector reads that snapshot, so a scrape
never touches the engine (which belongs to the step-loop thread alone).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.gc_pauses import GcPauses
from producers.protocol import Status

STATS_EVERY_S = 0.5

# Engine cumulative counters -> (metric name, help).
_ENGINE_COUNTERS = {
    "num_prompt_tokens": ("sluiceway_engine_prompt_tokens", "prompt tokens processed"),
    "num_generation_tokens": ("sluiceway_engine_generation_tokens", "tokens generated"),
    "num_preemptions": ("sluiceway_engine_preemptions", "sequences preempted (swapped out or recomputed)"),
    "num_swapped_out_blocks": ("sluiceway_engine_swapped_out_blocks", "KV blocks copied to the CPU swap pool"),
    "num_swapped_in_blocks": ("sluiceway_engine_swapped_in_blocks", "KV blocks copied back from the swap pool"),
    "swap_out_bytes": ("sluiceway_engine_swap_out_bytes", "bytes copied to the swap pool"),
    "swap_in_bytes": ("sluiceway_engine_swap_in_bytes", "bytes copied back from the swap pool"),
    "num_swap_outs": ("sluiceway_engine_swap_outs", "sequences swapped out to the CPU pool"),
    "num_swap_ins": ("sluiceway_engine_swap_ins", "sequences swapped back in"),
    "num_recomputes": ("sluiceway_engine_recomputes", "sequences preempted by recompute (a full swap pool included)"),
    "num_rank_preemptions": ("sluiceway_engine_rank_preemptions",
                             "preemptions that gave a seat to a higher-ranked sequence (interactive over bulk)"),
    "num_express": ("sluiceway_engine_express_prompts",
                    "prompts run in the express lane beside the step in flight (--express-lane-tokens)"),
}
# Engine gauges -> (metric name, help).
_ENGINE_GAUGES = {
    "num_running": ("sluiceway_engine_running", "sequences running"),
    "num_waiting": ("sluiceway_engine_waiting", "requests waiting inside the engine"),
    "num_swapped": ("sluiceway_engine_swapped", "sequences swapped out to the CPU pool"),
    "num_gpu_blocks": ("sluiceway_kv_gpu_blocks", "KV blocks on the GPU"),
    "num_free_gpu_blocks": ("sluiceway_kv_gpu_free_blocks", "free KV blocks on the GPU"),
    "num_cpu_blocks": ("sluiceway_swap_blocks", "KV blocks in the CPU swap pool"),
    "num_free_cpu_blocks": ("sluiceway_swap_free_blocks", "free KV blocks in the CPU swap pool"),
    "swap_pool_bytes": ("sluiceway_swap_pool_bytes", "size of the CPU swap pool"),
    "swap_pool_resident_bytes": ("sluiceway_swap_pool_resident_bytes", "host memory the swap pool holds now"),
    "prefix_cache_hit_rate": ("sluiceway_prefix_cache_hit_rate", "share of prompt tokens served from the prefix cache"),
}


class Metrics:
    """Everything one worker exports."""

    def __init__(self, port: int | None = None, host: str = "0.0.0.0") -> None:
        self.port = port
        self.host = host
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("sluiceway_queue_depth", "jobs in a queue not yet taken by any worker", ["queue"], registry=r)
        self.queue_pending = Gauge("sluiceway_queue_pending", "jobs taken by a worker, not yet acknowledged", ["queue"], registry=r)
        self.in_flight = Gauge("sluiceway_jobs_in_flight", "jobs this worker holds", registry=r)
        self.admitted = Counter("sluiceway_jobs_admitted", "jobs added to the engine", registry=r)
        self.ended = Counter("sluiceway_jobs_finished", "jobs ended, by terminal status", ["status"], registry=r)
        self.dead_lettered = Counter("sluiceway_jobs_dead_lettered", "entries sent to the dead-letter stream", registry=r)
        self.engine_errors = Counter("sluiceway_engine_errors", "engine steps that raised", registry=r)
        self.step_seconds = Histogram(
            "sluiceway_engine_step_seconds", "wall time of one engine step", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
        )
        self.tokens_per_second = Gauge("sluiceway_generation_tokens_per_second", "generated tokens per second (last interval)", registry=r)
        self.swap_target = Gauge("sluiceway_swap_pool_target_bytes", "swap pool size the sizing policy asks for", registry=r)
        self.loop_alive = Gauge("sluiceway_worker_loop_timestamp_seconds", "unix time of the step loop's last turn", registry=r)
        self.writer_progress = Gauge("sluiceway_writer_progress_timestamp_seconds",
                                     "unix time the result writer last stored a round, or found nothing to store", registry=r)
        self.writer_unwritten = Gauge("sluiceway_writer_unwritten", "writes handed to the result writer, not yet stored", registry=r)
        self.writer_retries = Counter("sluiceway_writer_retries", "writer rounds retried after a Redis outage or transient error", registry=r)
        self.writes_fenced = Counter("sluiceway_writes_fenced", "writes refused because another run owns the job", registry=r)
        self.writes_unstorable = Counter("sluiceway_writes_unstorable", "jobs failed because their output could never be stored", registry=r)
        self.gc_pause = Histogram(
            "sluiceway_gc_pause_seconds", "garbage-collector pauses of the worker process (every thread waits)",
            ["generation"], registry=r, buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )
        self._gc = GcPauses(on_pause=lambda gen, seconds: self.gc_pause.labels(str(gen)).observe(seconds))
        for status in Status:
            if status.terminal:
                self.ended.labels(status.value)
        self._stats: Any = None
        self._last: tuple[float, int] | None = None  # (time, generation tokens)
        self.registry.register(_EngineCollector(self))
        self._server = None

    # --- updates ------------------------------------------------------------------------------
    def job_ended(self, status: str) -> None:
        self.ended.labels(status).inc()

    def observe_engine(self, stats: Any) -> None:
        """Store the engine's stats snapshot (step-loop thread) and update tokens/s."""
        self._stats = stats
        now = time.monotonic()
        tokens = getattr(stats, "num_generation_tokens", 0)
        if self._last is not None and now > self._last[0]:
            self.tokens_per_second.set((tokens - self._last[1]) / (now - self._last[0]))
        self._last = (now, tokens)

    def observe_backlog(self, depth: dict[str, tuple[int, int]]) -> None:
        for queue, (waiting, pending) in depth.items():
            self.queue_depth.labels(queue).set(waiting)
            self.queue_pending.labels(queue).set(pending)

    # --- the endpoint ----------------------------------------------------------------------------
    def start(self) -> None:
        self._gc.install()
        if self.port is not None:
            self._server, _ = start_http_server(self.port, addr=self.host, registry=self.registry)
            self.port = self._server.server_port

    def stop(self) -> None:
        self._gc.uninstall()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _EngineCollector:
    """Exports the last engine stats snapshot."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        stats = self.metrics._stats
        if stats is None:
            return
        for field, (name, doc) in _ENGINE_COUNTERS.items():
            if getattr(stats, field, None) is not None:
                yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        for field, (name, doc) in _ENGINE_GAUGES.items():
            if getattr(stats, field, None) is not None:
                yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
