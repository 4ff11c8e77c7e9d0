"""How fast a kombu consumer takes Celery messages off a private redis-server: kombu's own
channel (BRPOP, then a write to ``unacked``) against the worker's (``worker/celery_taking.py``:
a BLMOVE that moves nothing, then one script that pops and records). Each message is acked
as it is delivered, with prefetch 1, as the ingress does when the engine is full.

    python scripts/celery_take_probe.py --messages 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import celery
from kombu import Exchange, Queue

from producers.celery_app import CELERY_QUEUE, TASK_NAME
from producers.embedded_redis import EmbeddedRedis
from worker.celery_taking import taking_channel


def fill(url: str, n: int) -> None:
    app = celery.Celery("probe", broker=url, backend=url)
    with app.producer_or_acquire() as producer:
        for i in range(n):
            app.send_task(TASK_NAME, kwargs={"prompt": f"task {i}"}, queue=CELERY_QUEUE, producer=producer)
    app.close()


def drain(url: str, n: int, atomic: bool) -> float:
    """Seconds to take, deliver and ack ``n`` messages."""
    app = celery.Celery("probe", broker=url, backend=url)
    app.conf.broker_transport_options = {"polling_interval": 0.1}
    conn = app.connection_for_read()
    if atomic:
        conn.transport.Channel = taking_channel(conn.transport.Channel)
    conn.ensure_connection(max_retries=1)
    seen = 0

    def on_message(body, message) -> None:
        nonlocal seen
        message.ack()
        seen += 1

    queue = Queue(CELERY_QUEUE, Exchange(CELERY_QUEUE, type="direct"), routing_key=CELERY_QUEUE)
    consumer = conn.Consumer(queue, callbacks=[on_message], accept=["json"], prefetch_count=1)
    consumer.consume()
    start = time.perf_counter()
    while seen < n:
        conn.drain_events(timeout=5)
    elapsed = time.perf_counter() - start
    consumer.cancel()
    conn.release()
    app.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"kombu": [], "atomic": []}
    with EmbeddedRedis() as server:
        client = server.client()
        for _ in range(args.rounds):
            for name in ("kombu", "atomic"):  # alternating, so drift hits both
                fill(server.url, args.messages)
                times[name].append(drain(server.url, args.messages, atomic=name == "atomic"))
                assert client.llen(CELERY_QUEUE) == 0 and client.hlen("unacked") == 0
    for name, runs in times.items():
        rates = [args.messages / t for t in runs]
        print(f"{name}: {statistics.median(rates):,.0f} messages/s (runs: {', '.join(f'{r:,.0f}' for r in rates)})")
    print(f"atomic / kombu: {statistics.median(times['kombu']) / statistics.median(times['atomic']):.3f}")


if __name__ == "__main__":
    main()
