"""Key names of the OpenAI Batch API's state (files and batches), beside protocol v1's keys.

Gateways keep all of it in Redis, so any gateway can serve any request and carry on any
batch (docs/BATCHES.md). ``tenant`` is the gateway's name of the caller's API key.

NOTE: a file's keys share a hash tag (its id in braces), and so do a batch's, so that every
script touches keys of one Redis Cluster slot.

NOTE: a key named after a tenant lies under a ``tenant`` segment of its own
(``{prefix}:batches:tenant:{tenant}``), under which no fixed key ever goes: as
``{prefix}:batches:{tenant}`` a tenant named ``active`` was the active set. Gateways before
that wrote ``old_files`` and ``old_batches``; ``gateway/batch_store.py`` moves what they hold.
"""

from __future__ import annotations

from producers.protocol.keys import DEFAULT_PREFIX, Keys


class BatchKeys:
    """Every key of the Batch API's store, under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = Keys(prefix).prefix

    def file(self, file_id: str) -> str:
        """Hash: a file's object (tenant, purpose, filename, bytes, created_at, expires_at, where its bytes are)."""
        return f"{self.prefix}:file:{{{file_id}}}"

    def file_data(self, file_id: str) -> str:
        """String: the bytes of an uploaded file kept in Redis."""
        return f"{self.prefix}:file:{{{file_id}}}:data"

    def files(self, tenant: str) -> str:
        """Sorted set: a tenant's file ids, scored by creation time."""
        return f"{self.prefix}:files:tenant:{tenant}"

    def old_files(self, tenant: str) -> str:
        """``files`` as gateways before the tenant segment named it (read only to move it)."""
        return f"{self.prefix}:files:{tenant}"

    @property
    def expiring_files(self) -> str:
        """Sorted set: ids of the files with an ``expires_at``, scored by when a sweep removes them."""
        return f"{self.prefix}:expiring-files"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's object and its feeder's cursor."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batches(self, tenant: str) -> str:
        """Sorted set: a tenant's batch ids, scored by creation time."""
        return f"{self.prefix}:batches:tenant:{tenant}"

    def old_batches(self, tenant: str) -> str:
        """``batches`` as gateways before the tenant segment named it (for the tenant ``active``: the active set)."""
        return f"{self.prefix}:batches:{tenant}"

    @property
    def active(self) -> str:
        """Set: ids of the batches not ended yet, which gateways take leases on."""
        return f"{self.prefix}:batches:active"

    def lease(self, batch_id: str) -> str:
        """String with a TTL: the gateway that feeds the batch now (renewed while it does)."""
        return f"{self.prefix}:batch:{{{batch_id}}}:lease"

    def pending(self, batch_id: str) -> str:
        """Hash: job id -> JSON of the input line whose job is in flight."""
        return f"{self.prefix}:batch:{{{batch_id}}}:pending"

    def answered(self, batch_id: str) -> str:
        """Bitmap: bit N is set once line N is answered (each line is answered exactly once)."""
        return f"{self.prefix}:batch:{{{batch_id}}}:answered"

    def duplicates(self, batch_id: str) -> str:
        """Hash: line -> the earlier line with the same custom_id (found while validating)."""
        return f"{self.prefix}:batch:{{{batch_id}}}:duplicates"

    def output(self, batch_id: str) -> str:
        """List: the output file's lines, appended as jobs end."""
        return f"{self.prefix}:batch:{{{batch_id}}}:output"

    def errors(self, batch_id: str) -> str:
        """List: the error file's lines."""
        return f"{self.prefix}:batch:{{{batch_id}}}:errors"
