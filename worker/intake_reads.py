"""The queue reader's reads of its streams (``worker.intake.RedisIntake`` runs them): its own
pending entries, idle entries of any consumer, new entries in priority order, and the wait on
empty queues. Each returns ``(queue, shard, entries)`` batches; ``shard`` is None in the
single-node layout."""

from __future__ import annotations

import logging
import time

from producers.protocol import CONSUMER_GROUP
from worker.entries import as_text
from worker.logs import event

log = logging.getLogger("worker.intake")

# NOTE: a later queue's entries per stream and round, at most: one batch of a whole backlog
# held interactive jobs out while it was validated and started.
LATER_QUEUE_BATCH = 8
RESERVE_WAIT_MS = 20  # a wait on the first queue alone, while the room left is its reserve


class StreamReads:
    """The reads of ``RedisIntake``, which holds the state they use (streams, cursors, the waiter)."""

    def _read_own_pending(self, room: int) -> list:
        cursor = self._own_cursor
        streams = {key: at for key, at in cursor.items() if at is not None}
        if not streams:
            self._own_cursor = None
            return []
        if self.keys.shards:  # one read per stream (their slots differ), never more than room in all
            reply, left = [], room
            for key, at in list(streams.items()):
                if left <= 0:
                    del streams[key]  # read at the next round
                    continue
                got = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, {key: at}, count=left) or []
                reply += got
                left -= sum(len(entries) for _, entries in got)
        else:
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=room)
        found = {as_text(key): entries for key, entries in reply or [] if entries}
        for key in streams:  # a stream that returned nothing has no more pending entries of ours
            cursor[key] = as_text(found[key][-1][0]) if key in found else None
        return [(*self._stream_of[key], entries) for key, entries in found.items()]

    def _claim_idle(self, room: int) -> list:
        batches = []
        for queue, shard, key in self.streams:
            if room <= 0:
                break
            reply = self.client.xautoclaim(key, CONSUMER_GROUP, self.consumer,
                                           self.claim_idle_ms, start_id=self._claim_cursor[key], count=room)
            cursor, entries = as_text(reply[0]), reply[1]
            self._claim_cursor[key] = cursor
            if entries:
                event(log, "intake.claimed", queue=queue, shard=shard, entries=len(entries))
                batches.append((queue, shard, entries))
                room -= len(entries)
        if all(c == "0-0" for c in self._claim_cursor.values()):
            self._next_claim_at = time.monotonic() + self.claim_every_s
        return batches

    def _read_first_queue(self, room: int) -> list:
        """New entries of the first queue alone, without waiting (a later queue's batch is deferred)."""
        return self._read_streams(room, first_only=True)

    def _read_streams(self, room: int, first_only: bool = False) -> list:
        """New entries, queue by queue in priority order, without waiting: the first queue's up to
        ``room``, a later queue's up to LATER_QUEUE_BATCH and never into the first queue's reserve."""
        batches = []
        first = self.queues[0]
        for queue, shard, key in self.streams:
            if first_only and queue != first:
                continue
            count = room if queue == first else min(room - self.top_queue_reserve, LATER_QUEUE_BATCH)
            if count <= 0:
                break
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, {key: ">"}, count=count)
            for _, entries in reply or []:
                if entries:
                    batches.append((queue, shard, entries))
                    room -= len(entries)
        return batches

    def _read_new(self, room: int) -> list:
        if not self._queues_empty:
            batches = self._read_streams(room)
            if batches:
                return batches
        # NOTE: every queue is empty: wait on all of them at once (only the first when the room
        # left is its reserve), one entry each, then go back to the priority-ordered reads; the
        # wait ends in time for the next claim round.
        readable = self.queues if room > self.top_queue_reserve else self.queues[:1]
        until_claim_ms = int(1000 * (self._next_claim_at - time.monotonic()))
        if self._stop.is_set():
            return []
        block_ms = max(1, min(self.block_ms, until_claim_ms))
        if len(readable) < len(self.queues):
            # NOTE: the later queues were not read because the engine's room is down to the first
            # queue's reserve, not because they are empty: wait on the first one only briefly, so
            # that their backlog is read again as soon as finished jobs free room (a full wait
            # left a draining engine without new bulk work for up to BLOCK_MS)
            block_ms = min(block_ms, RESERVE_WAIT_MS)
        streams = [(q, shard, key) for q, shard, key in self.streams if q in readable]
        if self._shard_waiter is not None:
            # NOTE: a multi-stream XREADGROUP across slots is a CROSSSLOT error, but the queues of
            # one shard share its hash tag: one wait per shard, all at once (worker/waits.py)
            by_shard: dict[int, dict] = {}
            for _, shard, key in streams:
                by_shard.setdefault(shard, {})[key] = ">"
            reply = self._shard_waiter.xreadgroup(CONSUMER_GROUP, self.consumer, by_shard, block_ms)
        else:  # one server: one read waits on every stream, of every shard too
            reply = self._waiter.xreadgroup(CONSUMER_GROUP, self.consumer, {key: ">" for _, _, key in streams},
                                            block_ms)
        got = {as_text(key): entries for key, entries in reply or [] if entries}
        found = [(q, shard, got[key]) for q, shard, key in streams if key in got]  # in priority order
        self._queues_empty = not found and not (self._shard_waiter is not None and self._shard_waiter.stale)
        return found
