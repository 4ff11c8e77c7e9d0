"""The statuses of an OpenAI batch (the gateway's ``/v1/batches``), as the OpenAI API names them."""

from __future__ import annotations

from enum import Enum


class BatchStatus(str, Enum):
    VALIDATING = "validating"  # its input file is read once: rows counted, duplicate custom_ids found
    FAILED = "failed"  # the input file is not JSONL (or is gone)
    IN_PROGRESS = "in_progress"  # its lines are fed to the queue
    FINALIZING = "finalizing"  # every line is answered; its output and error files are recorded
    COMPLETED = "completed"
    EXPIRED = "expired"  # its completion window passed first
    CANCELLING = "cancelling"  # cancelled: its jobs in flight are being cancelled
    CANCELLED = "cancelled"


# the values, so that a status read from Redis (a plain string) is looked up as it is
BATCH_ENDED = frozenset(s.value for s in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                                          BatchStatus.CANCELLED))
