"""Taking a Celery message off the Redis broker without a moment when no list holds it.

kombu's Redis transport takes a message with ``BRPOP`` and records it in ``unacked`` in a
second command, once the reply is read and the message is handed to the consumer. A worker
killed between the two loses the message: neither the queue nor ``unacked`` holds it. Here the
blocking command only waits: ``BLMOVE q q RIGHT RIGHT`` moves the queue's last message to where
it already is, so it returns as soon as the queue holds one and changes nothing. Then one script
(``TAKE``) pops the oldest message of the queue's keys in kombu's priority order and records it
in ``unacked`` and ``unacked_index`` exactly as kombu's ``QoS.append`` does, in one atomic step;
kombu's ``QoS.append`` then keeps the message in memory only (its write would repeat the script's).

``taking_channel(kombu_channel_class)`` makes the channel class (plain Redis or Sentinel) that
does this. The wait watches the queue's base key; a message sent with a Celery ``priority``
lands in another key of the queue and is taken at the next round, within the poll interval
(the ingress's ``BRPOP_S``). kombu's restore, acknowledgement and visibility index are
unchanged. Needs ``BLMOVE`` (Redis >= 6.2) and no ``global_keyprefix``; otherwise the channel
takes messages as kombu does. The worker's ACL role grants BLMOVE and RPOP on Celery's keys
(``producers/acl.py``; a script's commands are checked against its caller).
"""

from __future__ import annotations

import functools
import logging
import time
from queue import Empty
from typing import Any

from producers.protocol.celery_scripts import TAKE

log = logging.getLogger(__name__)

# kombu internals the channel below relies on (kombu 5.7): without them it takes as kombu does
_NEEDS = ("QoS", "_q_for_pri", "priority_steps", "_brpop_start", "_brpop_read", "_flush_brpop_reauth", "conn_or_acquire",
          "unacked_key", "unacked_index_key", "sep", "active_queues")


@functools.cache
def taking_channel(base: type) -> type:
    """The subclass of kombu's Redis channel class ``base`` that takes messages atomically
    (module docstring); ``base`` itself if this kombu lacks what it overrides. One class per
    base: a reconnect reuses it and its registered script."""
    from kombu.utils.encoding import bytes_to_str  # NOTE: celery (and kombu) are an optional extra
    from kombu.utils.json import loads
    from redis.exceptions import ResponseError

    missing = [name for name in _NEEDS if not hasattr(base, name)]
    if missing:
        log.warning("celery: kombu %s lacks %s: messages are taken with kombu's BRPOP",
                    base.__module__, ", ".join(missing))
        return base

    class TakingQoS(base.QoS):
        def append(self, message: Any, delivery_tag: str) -> None:
            if delivery_tag is not None and delivery_tag == self.channel._recorded:
                self.channel._recorded = None  # the take script wrote kombu's entry already
                super(base.QoS, self).append(message, delivery_tag)  # kombu's in-memory books only
                return
            super().append(message, delivery_tag)

    class TakingChannel(base):
        QoS = TakingQoS
        _recorded = None  # the delivery tag the take script just recorded in unacked
        _take_script = None
        _waits_only = None  # no global_keyprefix (decided once); False too once Redis refuses BLMOVE

        def _atomic(self) -> bool:
            if self._waits_only is None:
                self._waits_only = not getattr(self, "global_keyprefix", None)
                if not self._waits_only:
                    log.warning("celery: a global_keyprefix is set: messages are taken with kombu's BRPOP")
            return self._waits_only

        def _brpop_start(self, timeout: float | None = None) -> None:
            if not self._atomic():
                return super()._brpop_start(timeout)
            if timeout is None:
                timeout = self.brpop_timeout
            queues = self._queue_cycle.consume(len(self.active_queues))
            if not queues:
                return None
            self._taking = queues
            self._in_poll = self.client.connection
            self._brpop_sent_at = time.monotonic()
            key = queues[0]  # the base key (priority 0) of the queue whose turn it is
            self.client.connection.send_command("BLMOVE", key, key, "RIGHT", "RIGHT", timeout or 0)
            return None

        def _brpop_read(self, **options: Any) -> bool:
            if not self._waits_only:
                return super()._brpop_read(**options)
            try:
                try:  # the wait's reply: the message left where it was, or nil at the timeout
                    self.client.parse_response(self.client.connection, "BLMOVE", **options)
                except self.connection_errors:
                    self.client.connection.disconnect()
                    raise
                except ResponseError as exc:
                    if "unknown command" not in str(exc).lower():
                        raise
                    self._waits_only = False  # NOTE: Redis < 6.2; the next round is kombu's BRPOP
                    log.warning("celery: this Redis has no BLMOVE: messages are taken with kombu's BRPOP")
                    raise Empty() from None
                keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in self._taking]
                with self.conn_or_acquire() as client:
                    if self._take_script is None:
                        type(self)._take_script = client.register_script(TAKE)
                    taken = self._take_script(keys=[*keys, self.unacked_key, self.unacked_index_key],
                                              args=[time.time()], client=client)
                if not taken:
                    raise Empty()
                key, raw, recorded = taken
                dest = bytes_to_str(key).rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                payload = loads(bytes_to_str(raw))
                self._recorded = payload["properties"]["delivery_tag"] if recorded else None
                self.connection._deliver(payload, dest)
                return True
            finally:
                self._in_poll = None
                self._flush_brpop_reauth()

    TakingChannel.__name__ = TakingChannel.__qualname__ = f"Taking{base.__name__}"
    return TakingChannel
