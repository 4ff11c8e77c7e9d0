"""A real stack for the Batch API tests: a private redis-server, a worker process on the tiny
model (``--served-model-name tiny``), and gateway processes (``sluiceway serve`` on free ports)
that can be killed with SIGKILL and started again, with two tenants, ``alice`` and ``bob``.

NOTE: its own Redis rather than the package's ``stack``: every gateway on a Redis feeds its
batches, so the package's gateway would take leases the kill test means for its own pair."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.conftest import ALICE, BOB, KEYS, MODEL, GatewayProcess, WorkerStack, hand_record, wait_for

__all__ = ["ALICE", "BOB", "KEYS", "MODEL", "PARKED", "BatchStack"]
PARKED = "parked"  # a live worker record whose queue nobody reads: its jobs wait


class BatchStack(WorkerStack):
    """Redis, one worker, and gateways started on demand (``gateway()``), all stopped by ``close``."""

    def __init__(self, tiny_model: Path, tmp_path: Path) -> None:
        super().__init__(tiny_model, tmp_path, "--max-num-seqs", "64", name="batch-worker",
                         records={"parked-1": hand_record("parked-1", PARKED, [PARKED], alive=True)})
        wait_for(lambda: "batch-worker" in self.r.hgetall(KEYS.workers), timeout=120, what="the worker's heartbeat")

    def gateway(self, *args: str, **env: str) -> GatewayProcess:
        """A gateway that feeds batches quickly; ``args`` are more flags, ``env`` sets its ``SLUICEWAY_BATCH_*``."""
        return self.start_gateway(*args, **{"SLUICEWAY_BATCH_POLL_SECONDS": "0.05",
                                            "SLUICEWAY_BATCH_LEASE_SECONDS": "1", **env})
