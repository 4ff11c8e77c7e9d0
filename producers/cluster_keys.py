"""Keys of the commands the protocol sends a Redis Cluster, read from their arguments: redis-py
would ask the server for them (``COMMAND GETKEYS``) at every call. Imports no torch."""

from __future__ import annotations

from typing import Any


def _word(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value.upper() if isinstance(value, str) else ""


def stream_or_script_keys(args: tuple) -> list | None:
    """The keys of an ``XREAD`` / ``XREADGROUP`` / ``EVAL`` / ``EVALSHA`` command, read from its
    arguments; None for another command, or one these rules do not read (the server is asked)."""
    name = _word(args[0]) if args else ""
    if name in ("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO"):
        try:
            count = int(args[2])
        except (IndexError, TypeError, ValueError):
            return None
        keys = list(args[3:3 + count])
        return keys if count > 0 and len(keys) == count else None
    if name not in ("XREAD", "XREADGROUP"):
        return None
    at = 1
    if name == "XREADGROUP":
        if len(args) < 4 or _word(args[1]) != "GROUP":
            return None
        at = 4  # after GROUP group consumer
    while at < len(args):
        word = _word(args[at])
        if word in ("COUNT", "BLOCK"):
            at += 2
        elif word == "NOACK":
            at += 1
        elif word == "STREAMS":
            rest = args[at + 1:]
            return list(rest[:len(rest) // 2]) if rest and len(rest) % 2 == 0 else None
        else:
            return None
    return None


class LocalKeys:
    """A cluster client's command parser that reads the keys of stream reads and scripts itself.

    NOTE: redis-py asks the server (``COMMAND GETKEYS``, a round trip to one node) for the keys of
    every command whose keys move (``XREADGROUP``, ``XREAD``; ``EVALSHA`` in a pipeline), to
    route it, and for ``XREADGROUP`` twice: ``sluiceway bench fleet`` on a cluster counted 4.3
    such calls per job (10% of the job's commands) and 2 per read of an idle worker."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        keys = stream_or_script_keys(args)
        return keys if keys is not None else self._inner.get_keys(redis_conn, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class AsyncLocalKeys(LocalKeys):
    async def get_keys(self, *args: Any) -> Any:  # type: ignore[override]
        keys = stream_or_script_keys(args)
        return keys if keys is not None else await self._inner.get_keys(*args)
