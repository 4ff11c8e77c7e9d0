"""One reader for many token streams: a single ``XREAD BLOCK`` over every stream followed.

``AsyncClient(shared_streams=True)`` (the gateway's) reads the token streams of all its
concurrent ``stream_delta_batches`` calls with one task: it sends one ``XREAD COUNT n BLOCK
ms STREAMS k1 .. kn id1 .. idn`` at a time, over every stream someone follows, on a
connection of its own, and hands each stream's entries to the call that follows it (which
applies the exactly-once rule of ``producers/deltas.py`` itself, as before). A thousand
streams then cost one Redis round trip per batch of writes instead of one each.

A stream followed while the read is blocked on the others would wait for the block to end,
so ``follow`` ends it at once with ``CLIENT UNBLOCK`` on the reader's connection (at most one
per command sent); the next command names the new stream too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from producers.jobs import OUTAGE_ERRORS, Outage, block_chunk, block_ms

log = logging.getLogger(__name__)

# NOTE: without CLIENT ID / CLIENT UNBLOCK (an ACL that refuses them) a new stream cannot end
# the blocked read; the reader then blocks this long at most, the extra wait a new stream sees.
WAKELESS_BLOCK_S = 0.05
CLOSE_WAIT_S = 1.0  # for the reader task to end, when the client closes
ERROR_PAUSE_S = 0.1  # after a refused read, before the next one (for the streams followed since)
Entry = tuple[str, dict[str, str]]


class Tail:
    """One followed stream: the entries the reader fetched that its follower has not taken."""

    __slots__ = ("key", "last_id", "entries", "waiter", "error")

    def __init__(self, key: str, last_id: str) -> None:
        self.key = key
        self.last_id = last_id  # the last entry fetched: where the next read of this stream starts
        self.entries: list[Entry] = []
        self.waiter: asyncio.Future | None = None  # its follower's wait, while it waits
        self.error: BaseException | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class SharedStreamReader:
    """The reader task of one ``redis.asyncio`` client (one event loop): ``follow`` a stream,
    ``take`` what arrived (waiting up to a timeout), ``leave`` it."""

    def __init__(self, redis: Any, socket_timeout: float | None, count: int = 256) -> None:
        self.redis = redis
        self.socket_timeout = socket_timeout
        self.count = count
        self._tails: dict[str, Tail] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._conn: Any = None
        self._client_id: int | None = None
        self._blocked = False  # a command is out, blocked on the streams it names
        self._woken = False  # an unblock was sent for the command that is out
        self._wakes: set[asyncio.Task] = set()
        self.commands = 0  # XREAD commands sent (for tests and benchmarks)
        self._closed = False

    def follow(self, key: str, last_id: str = "0-0") -> Tail | None:
        """Start following ``key`` after ``last_id``; None when it is followed already (by
        another call of this process: that one reads it on its own connection)."""
        if self._closed:
            raise RuntimeError("the client is closed")
        if key in self._tails:
            return None
        tail = self._tails[key] = Tail(key, last_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sluiceway-stream-reader")
        self._changed.set()
        if self._blocked and not self._woken and self._client_id is not None:
            self._woken = True
            task = asyncio.ensure_future(self._unblock(self._client_id))
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)
        return tail

    def leave(self, tail: Tail) -> None:
        if self._tails.get(tail.key) is tail:
            del self._tails[tail.key]

    async def take(self, tail: Tail, timeout: float) -> list[Entry]:
        """The entries fetched for ``tail`` since the last take, waiting up to ``timeout``
        seconds for some (an empty list then); raises the reader's error after a long outage."""
        if not tail.entries and tail.error is None and timeout > 0:
            # NOTE: a bare future and a timer, not wait_for: that costs a task per wait, and
            # a thousand streams wait once per token entry each
            loop = asyncio.get_running_loop()
            tail.waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, tail.wake)
            try:
                await waiter
            finally:
                timer.cancel()
                tail.waiter = None
        if tail.error is not None:
            error, tail.error = tail.error, None
            raise error
        entries, tail.entries = tail.entries, []
        return entries

    async def close(self) -> None:
        """Stop the reader and give its connection back."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            # NOTE: the blocked read is ended first (CLIENT UNBLOCK, or its socket closed): a
            # cancel that lands inside redis-py's blocked read was seen to stay pending there
            if self._client_id is not None:
                await self._unblock(self._client_id)
            task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
            if not task.done() and self._conn is not None:
                await self._conn.disconnect(nowait=True)
                await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
        for wake in list(self._wakes):
            wake.cancel()
        await self._drop()

    async def _unblock(self, client_id: int) -> None:
        try:
            await self.redis.client_unblock(client_id)
        except Exception:  # NOTE: the read then ends at its own timeout, a delay and no more
            log.debug("stream_reader.unblock_failed", exc_info=True)

    async def _connection(self) -> Any:
        if self._conn is None:
            pool = self.redis.connection_pool
            conn = await pool.get_connection()
            try:
                await conn.send_command("CLIENT", "ID")
                self._client_id = int(await conn.read_response())
            except OUTAGE_ERRORS:
                await pool.release(conn)
                raise
            except Exception:  # CLIENT ID refused (an ACL): read without waking (WAKELESS_BLOCK_S)
                self._client_id = None
            self._conn = conn
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn, self._client_id = self._conn, None, None
        if conn is not None:
            await conn.disconnect()
            await self.redis.connection_pool.release(conn)

    def _block_ms(self) -> int:
        cap = WAKELESS_BLOCK_S if self._client_id is None else 60.0
        return block_ms(block_chunk(None, self.socket_timeout, cap=cap))

    async def _run(self) -> None:
        outage = Outage()
        while not self._closed:
            if not self._tails:
                self._changed.clear()
                await self._changed.wait()
                continue
            tails = dict(self._tails)
            try:
                conn = await self._connection()
                args = ["XREAD", "COUNT", self.count, "BLOCK", self._block_ms(), "STREAMS", *tails,
                        *(t.last_id for t in tails.values())]
                self._woken = False
                self._blocked = True
                self.commands += 1
                try:
                    await conn.send_command(*args)
                    reply = await self.redis.parse_response(conn, "XREAD")
                finally:
                    self._blocked = False
            except OUTAGE_ERRORS as exc:
                await self._drop()  # NOTE: a connection left mid-reply cannot be reused
                try:
                    await asyncio.sleep(outage.failed(exc))
                except OUTAGE_ERRORS as lasting:  # Redis away longer than the window: tell every follower
                    for tail in self._tails.values():
                        tail.error = lasting
                        tail.wake()
                    outage = Outage()
                continue
            except asyncio.CancelledError:
                await self._drop()
                raise
            except Exception as exc:  # a refused command (an ACL, say): every follower raises it
                log.warning("stream_reader.failed", exc_info=True)
                await self._drop()
                for tail in tails.values():
                    tail.error = exc
                    tail.wake()
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            outage.ok()
            for key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
                tail = tails.get(key)
                if tail is None or self._tails.get(key) is not tail or not entries:
                    continue  # left while the command was out
                tail.entries.extend(entries)
                tail.last_id = entries[-1][0]
                tail.wake()
