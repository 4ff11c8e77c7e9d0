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

On a Redis Cluster one command may name keys of one hash slot alone (CROSSSLOT otherwise), so
the streams are grouped by slot, a ``_Lane`` each: its own task, its own connection to the
node that holds the slot, one ``XREAD`` at a time over its streams, and its own wake (the
``CLIENT UNBLOCK`` goes to that node, where its blocked connection is). The cluster layout's
token streams carry their job's shard tag, so a gateway has at most ``--queue-shards`` lanes;
on one server every stream is in the one lane, and one ``XREAD`` reads them all, as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import AskError, ClusterDownError, MovedError, ResponseError, TryAgainError

from producers.cancelling import cancel_all
from producers.connection import is_cluster_client
from producers.jobs import OUTAGE_ERRORS, Outage, block_chunk, block_ms

log = logging.getLogger(__name__)

# NOTE: without CLIENT ID / CLIENT UNBLOCK (an ACL that refuses them) a new stream cannot end
# the blocked read; the reader then blocks this long at most, the extra wait a new stream sees.
WAKELESS_BLOCK_S = 0.05
CLOSE_WAIT_S = 1.0  # for the reader task to end, when the client closes
ERROR_PAUSE_S = 0.1  # after a refused read, before the next one (for the streams followed since)
# A slot that moved, or a cluster between two states: the lane asks for the slots again and
# reads on, and the followers see nothing of it.
CLUSTER_MOVES = (MovedError, AskError, ClusterDownError, TryAgainError)
Entry = tuple[str, dict[str, str]]


class Tail:
    """One followed stream: the entries the reader fetched that its follower has not taken."""

    __slots__ = ("key", "slot", "last_id", "entries", "waiter", "error")

    def __init__(self, key: str, last_id: str, slot: int | None = None) -> None:
        self.key = key
        self.slot = slot  # the stream's hash slot on a cluster (its lane); None on one server
        self.last_id = last_id  # the last entry fetched: where the next read of this stream starts
        self.entries: list[Entry] = []
        self.waiter: asyncio.Future | None = None  # its follower's wait, while it waits
        self.error: BaseException | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class SharedStreamReader:
    """The reader of one ``redis.asyncio`` client (one event loop): ``follow`` a stream, ``take``
    what arrived (waiting up to a timeout), ``leave`` it."""

    def __init__(self, redis: Any, socket_timeout: float | None, count: int = 256) -> None:
        self.redis = redis
        self.socket_timeout = socket_timeout
        self.count = count
        self.cluster = is_cluster_client(redis)
        self._tails: dict[str, Tail] = {}
        self._lanes: dict[int | None, _Lane] = {}  # slot (None on one server) -> its lane
        self.commands = 0  # XREAD commands sent, over every lane (for tests and benchmarks)
        self.closed = False

    def follow(self, key: str, last_id: str = "0-0") -> Tail | None:
        """Start following ``key`` after ``last_id``; None when it is followed already (by
        another call of this process: that one reads it on its own connection)."""
        if self.closed:
            raise RuntimeError("the client is closed")
        if key in self._tails:
            return None
        slot = self.redis.keyslot(key) if self.cluster else None
        tail = self._tails[key] = Tail(key, last_id, slot)
        lane = self._lanes.get(slot)
        if lane is None:
            lane = self._lanes[slot] = _Lane(self, slot)
        lane.add(tail)
        return tail

    def leave(self, tail: Tail) -> None:
        if self._tails.get(tail.key) is tail:
            del self._tails[tail.key]
            self._lanes[tail.slot].tails.pop(tail.key, None)

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
        """Stop every lane and give their connections back."""
        self.closed = True
        await asyncio.gather(*(lane.close() for lane in self._lanes.values()))


class _Lane:
    """The followed streams of one hash slot (of every stream, on one server): one task that
    sends one ``XREAD`` at a time over them, on a connection of its own to their node."""

    def __init__(self, reader: SharedStreamReader, slot: int | None) -> None:
        self.reader = reader
        self.redis = reader.redis
        self.slot = slot
        self.tails: dict[str, Tail] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._conn: Any = None
        self._node: Any = None  # the cluster node the connection is to (None on one server)
        self._client_id: int | None = None
        self._blocked = False  # a command is out, blocked on the streams it names
        self._woken = False  # an unblock was sent for the command that is out
        self._wakes: set[asyncio.Task] = set()

    def add(self, tail: Tail) -> None:
        self.tails[tail.key] = tail
        if self._task is None or self._task.done():
            name = "sluiceway-stream-reader" if self.slot is None else f"sluiceway-stream-reader-{self.slot}"
            self._task = asyncio.get_running_loop().create_task(self._run(), name=name)
        self._changed.set()
        if self._blocked and not self._woken and self._client_id is not None:
            self._woken = True
            task = asyncio.ensure_future(self._unblock(self._client_id, self._node))
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            # NOTE: the blocked read is ended first (CLIENT UNBLOCK, or its socket closed), and the
            # task cancelled until it ends: a cancel that lands as an XREAD's write ends is lost
            # (producers/cancelling.py; the read itself loses none), and the task went on into that
            # read, blocked until the disconnect below
            if self._client_id is not None:
                await self._unblock(self._client_id, self._node)
            if await cancel_all([task], CLOSE_WAIT_S) and self._conn is not None:
                await self._conn.disconnect(nowait=True)
                await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
        for wake in list(self._wakes):
            wake.cancel()
        await self._drop()

    async def _unblock(self, client_id: int, node: Any) -> None:
        try:
            if node is None:
                await self.redis.client_unblock(client_id)
            else:  # the node the blocked connection is to: a client id is one node's own
                await self.redis.execute_command("CLIENT UNBLOCK", client_id, target_nodes=node)
        except Exception:  # NOTE: the read then ends at its own timeout, a delay and no more
            log.debug("stream_reader.unblock_failed", exc_info=True)

    async def _connection(self) -> Any:
        if self._conn is None:
            if self.slot is None:
                conn = await self.redis.connection_pool.get_connection()
            else:
                await self.redis.initialize()  # the slots map (once; the cluster client's own)
                self._node = self.redis.nodes_manager.get_node_from_slot(self.slot)
                conn = self._node.acquire_connection()
            self._conn = conn
            try:
                await conn.send_command("CLIENT", "ID")
                self._client_id = int(await conn.read_response())
            except OUTAGE_ERRORS:
                await self._drop()
                raise
            except Exception:  # CLIENT ID refused (an ACL): read without waking (WAKELESS_BLOCK_S)
                self._client_id = None
        return self._conn

    async def _drop(self) -> None:
        conn, node = self._conn, self._node
        self._conn, self._node, self._client_id = None, None, None
        if conn is None:
            return
        await conn.disconnect()
        if node is None:
            await self.redis.connection_pool.release(conn)
        else:
            node.release(conn)

    async def _refresh(self) -> None:
        """Ask the cluster for its slots again (a node that died, a slot that moved)."""
        if self.slot is not None:
            try:
                await self.redis.nodes_manager.initialize()
            except Exception:  # NOTE: no node answers yet: the next read fails and asks again
                log.debug("stream_reader.refresh_failed", exc_info=True)

    def _block_ms(self) -> int:
        cap = WAKELESS_BLOCK_S if self._client_id is None else 60.0
        return block_ms(block_chunk(None, self.reader.socket_timeout, cap=cap))

    async def _read(self, tails: dict[str, Tail]) -> Any:
        conn = await self._connection()
        args = ["XREAD", "COUNT", self.reader.count, "BLOCK", self._block_ms(), "STREAMS", *tails,
                *(t.last_id for t in tails.values())]
        self._woken = False
        self._blocked = True
        self.reader.commands += 1
        try:
            await conn.send_command(*args)
            parser = self.redis if self._node is None else self._node
            return await parser.parse_response(conn, "XREAD")
        finally:
            self._blocked = False

    async def _run(self) -> None:
        outage = Outage()
        while not self.reader.closed:
            if not self.tails:
                self._changed.clear()
                await self._changed.wait()
                continue
            tails = dict(self.tails)
            try:
                reply = await self._read(tails)
            except OUTAGE_ERRORS as exc:
                await self._drop()  # NOTE: a connection left mid-reply cannot be reused
                await self._refresh()
                try:
                    await asyncio.sleep(outage.failed(exc))
                except OUTAGE_ERRORS as lasting:  # Redis away longer than the window: tell every follower
                    for tail in self.tails.values():
                        tail.error = lasting
                        tail.wake()
                    outage = Outage()
                continue
            except asyncio.CancelledError:
                await self._drop()
                raise
            except CLUSTER_MOVES:
                await self._drop()
                await self._refresh()
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            except Exception as exc:  # a refused command (an ACL, say): every follower raises it
                if isinstance(exc, ResponseError) and str(exc).startswith("UNBLOCKED"):
                    # NOTE: the server let the read go (a primary demoted by a planned failover
                    # does so to its blocked clients): a fresh connection finds the primary
                    await self._drop()
                    await self._refresh()
                    continue
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
                if tail is None or self.tails.get(key) is not tail or not entries:
                    continue  # left while the command was out
                tail.entries.extend(entries)
                tail.last_id = entries[-1][0]
                tail.wake()
