"""The queue reader's wait on empty queues: a blocking read that a stop can end at once; in the
cluster layout, one such read per shard, all at once."""

from __future__ import annotations

import logging
import select
import threading
import time

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
        self.send(group, consumer, streams, block_ms)
        return self.receive()

    def send(self, group: str, consumer: str, streams: dict, block_ms: int) -> None:
        """Send the blocking read (``receive`` reads its reply)."""
        conn = self._connection()
        args = ["XREADGROUP", "GROUP", group, consumer, "COUNT", 1, "BLOCK", block_ms, "STREAMS",
                *streams.keys(), *streams.values()]
        try:
            conn.send_command(*args)
        except BaseException:
            self.close()
            raise

    def receive(self) -> list | None:
        conn = self._conn
        try:
            return self.client.parse_response(conn, "XREADGROUP")
        except BaseException:
            self.close()  # NOTE: a connection left mid-reply cannot be reused
            raise

    def readable(self) -> bool:
        """Whether the reply has (begun to) come: ``receive`` would not block."""
        conn = self._conn
        return conn is None or conn.can_read(timeout=0)

    def socket(self):
        conn = self._conn
        return getattr(conn, "_sock", None) if conn is not None else None

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


TIMEOUT_GRACE_S = 0.05  # how long the other shards' reads are given to time out by themselves


class ShardWaiter:
    """The cluster layout's wait: one blocking ``XREADGROUP`` per shard (the streams of one shard
    share its hash tag, so one read takes all its queues), each on a connection of its own to
    the shard's master, sent all at once. The first reply ends the wait: the other reads are
    released with ``CLIENT UNBLOCK`` and their replies read too (an entry one of them took
    meanwhile is returned, never dropped). ``interrupt`` releases them all (a stop).

    NOTE: before, an idle worker swept every shard stream and blocked 100 ms on one in turn:
    (queues x shards + 1) reads per 100 ms. Now: one read per shard per wait (``block_ms``).
    ``stale``: a read met MOVED or ASK (a slot moved), or was let go UNBLOCKED (its key migrated
    away, or its node is no longer a primary): the reader reads through the cluster client
    next, which learns the new slots, before it waits again."""

    def __init__(self, client) -> None:
        self.client = client  # a redis.cluster.RedisCluster
        self._readers: dict[int, tuple[str, BlockingReader]] = {}
        self._lock = threading.Lock()
        self.stale = False

    def _reader(self, shard: int, key: str) -> BlockingReader:
        node = self.client.get_node_from_key(key)
        with self._lock:
            have = self._readers.get(shard)
            if have is not None and have[0] == node.name:
                return have[1]
            reader = BlockingReader(node.redis_connection)
            self._readers[shard] = (node.name, reader)
        if have is not None:
            have[1].close()
        return reader

    def xreadgroup(self, group: str, consumer: str, streams_by_shard: dict[int, dict], block_ms: int) -> list:
        """Every reply's ``[key, entries]`` pairs (the keys of every shard that answered with entries)."""
        self.stale = False
        sent: list[BlockingReader] = []
        try:
            for shard, streams in streams_by_shard.items():
                reader = self._reader(shard, next(iter(streams)))
                reader.send(group, consumer, streams, block_ms)
                sent.append(reader)
            started = time.monotonic()
            self._wait_first(sent, block_ms / 1000 + 1.0)
            if time.monotonic() - started >= block_ms / 1000 - 0.005:
                # NOTE: the first read timed out: the others do within moments; no UNBLOCK for them
                self._wait_all(sent, TIMEOUT_GRACE_S)
            for reader in sent:
                if not reader.readable():
                    reader.interrupt()
            found: list = []
            for reader in sent:
                try:
                    found += reader.receive() or []
                except redis.ResponseError as exc:
                    # NOTE: UNBLOCKED: the server let the read go because its key left (a reshard's
                    # MIGRATE deletes it on the old owner) or the node stopped being a primary
                    if not str(exc).startswith(("MOVED", "ASK", "UNBLOCKED")):
                        raise
                    self.stale = True
            return found
        except BaseException:
            for reader in sent:
                reader.close()
            raise

    @staticmethod
    def _wait_all(readers: list[BlockingReader], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            waiting = [s for s in (r.socket() for r in readers if not r.readable()) if s is not None]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            select.select(waiting, [], [], left)

    @staticmethod
    def _wait_first(readers: list[BlockingReader], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(r.readable() for r in readers):
            sockets = [s for s in (r.socket() for r in readers) if s is not None]
            left = deadline - time.monotonic()
            if not sockets or left <= 0:
                return
            select.select(sockets, [], [], left)

    def interrupt(self) -> None:
        with self._lock:
            readers = [reader for _, reader in self._readers.values()]
        for reader in readers:
            reader.interrupt()

    def close(self) -> None:
        with self._lock:
            readers = [reader for _, reader in self._readers.values()]
            self._readers.clear()
        for reader in readers:
            reader.close()
