"""The queue reader's wait on empty queues: a blocking read that a stop can end at once."""

from __future__ import annotations

import logging
import threading

import redis

from worker.logs import event

log = logging.getLogger(__name__)


class BlockingReader:
    """Blocking ``XREADGROUP`` on one connection of its own, which ``interrupt`` (from any thread)
    releases at once with ``CLIENT UNBLOCK``; the connection comes from the client's pool, so
    it follows the client's URL (a Sentinel's current primary too)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._conn = None
        self._client_id: int | None = None
        self._lock = threading.Lock()

    def xreadgroup(self, group: str, consumer: str, streams: dict, block_ms: int) -> list | None:
        conn = self._connection()
        args = ["XREADGROUP", "GROUP", group, consumer, "COUNT", 1, "BLOCK", block_ms, "STREAMS",
                *streams.keys(), *streams.values()]
        try:
            conn.send_command(*args)
            return self.client.parse_response(conn, "XREADGROUP")
        except BaseException:
            self.close()  # NOTE: a connection left mid-reply cannot be reused
            raise

    def _connection(self):
        if self._conn is None:
            conn = self.client.connection_pool.get_connection()
            try:
                conn.send_command("CLIENT", "ID")
                client_id = int(conn.read_response())
            except BaseException:
                conn.disconnect()
                self.client.connection_pool.release(conn)
                raise
            with self._lock:
                self._conn, self._client_id = conn, client_id
        return self._conn

    def interrupt(self) -> None:
        with self._lock:
            client_id = self._client_id
        if client_id is None:
            return
        try:
            self.client.client_unblock(client_id)
        except redis.RedisError as exc:  # the wait then ends at its own timeout
            event(log, "intake.unblock_failed", logging.WARNING, error=str(exc))

    def close(self) -> None:
        with self._lock:
            conn, self._conn, self._client_id = self._conn, None, None
        if conn is not None:
            conn.disconnect()
            self.client.connection_pool.release(conn)
