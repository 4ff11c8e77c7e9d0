"""Registering the protocol's Lua scripts on a client: redis-py's ``register_script`` on one
server (unchanged), ``ClusterScript`` on a Redis Cluster.

NOTE: redis-py's cluster pipelines refuse ``evalsha`` (its ``Script`` objects call it), yet every
component pipelines its scripts. On a cluster a script call is therefore queued as a plain
``EVALSHA`` command, which the pipeline routes by its keys' slot (the cluster layout puts every
key of one call in one slot). A pipeline cannot load a missing script and retry, so the script
is loaded on every primary (``SCRIPT LOAD`` goes to all of them) when registered, checked again
(``SCRIPT EXISTS``, all primaries) at most every ``RECHECK_S`` while in use, and loaded again
after a node lost it (a restart, a failover to an empty node): the calls that met NOSCRIPT in the
meantime fail with that error, which the worker counts as transient (retried, never a job's end).

This module imports no torch (``producers/`` never does).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Sequence

import redis
import redis.asyncio.cluster as aiocluster
import redis.cluster

from producers.connection import is_cluster_client

RECHECK_S = 5.0


def register(client: Any, source: str) -> Any:
    """A callable ``script(keys=..., args=..., client=...)`` for ``source`` on ``client``."""
    if is_cluster_client(client):
        return ClusterScript(client, source)
    return client.register_script(source)


class ClusterScript:
    """One script on a cluster client (sync or asyncio); called as redis-py's ``Script`` is."""

    def __init__(self, client: Any, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.asyncio = isinstance(client, aiocluster.RedisCluster)
        self._checked_at = float("-inf")

    def __call__(self, keys: Sequence = (), args: Sequence = (), client: Any = None) -> Any:
        target = self.client if client is None else client
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        if self.asyncio:
            return self._call_async(target, command)
        if time.monotonic() - self._checked_at > RECHECK_S:
            self._ensure_loaded()
        if isinstance(target, redis.cluster.ClusterPipeline):
            return target.execute_command(*command)
        try:
            return target.execute_command(*command)
        except redis.exceptions.NoScriptError:
            self._checked_at = float("-inf")
            self._ensure_loaded()
            return target.execute_command(*command)

    def _ensure_loaded(self) -> None:
        if not all(self._flags(self.client.script_exists(self.sha))):
            self.client.script_load(self.source)
        self._checked_at = time.monotonic()

    async def _call_async(self, target: Any, command: tuple) -> Any:
        if time.monotonic() - self._checked_at > RECHECK_S:
            if not all(self._flags(await self.client.script_exists(self.sha))):
                await self.client.script_load(self.source)
            self._checked_at = time.monotonic()
        if isinstance(target, aiocluster.ClusterPipeline):
            return target.execute_command(*command)
        try:
            return await target.execute_command(*command)
        except redis.exceptions.NoScriptError:
            await self.client.script_load(self.source)
            return await target.execute_command(*command)

    @staticmethod
    def _flags(reply: Any) -> list[bool]:
        """``SCRIPT EXISTS`` of one sha, however redis-py merged the primaries' answers."""
        if isinstance(reply, dict):
            return [bool(v[0] if isinstance(v, list) else v) for v in reply.values()]
        return [bool(v) for v in (reply if isinstance(reply, list) else [reply])]
