"""Prometheus metrics of one gateway process, on its own registry, served at ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sluiceway_gateway_requests", "requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_progress = Gauge("sluiceway_gateway_requests_in_progress", "requests being answered",
                                 ["endpoint"], registry=r)
        self.latency = Histogram("sluiceway_gateway_request_seconds", "request received -> last byte sent",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("sluiceway_gateway_time_to_first_token_seconds",
                              "request received -> first token sent (streams)", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("sluiceway_gateway_completion_tokens", "completion tokens answered", ["endpoint"],
                              registry=r)
        self.cancelled = Counter("sluiceway_gateway_disconnects", "requests whose client left; their job cancelled",
                                 ["endpoint"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
