"""Protocol v1: the contract between producers and workers (see PROTOCOL.md).

Every Redis key name (``keys``), status (``statuses``), payload schema (``job``, ``schemas``),
limit (``limits``) and Lua script (``scripts``, ``worker_scripts``) lives in this package.
Payloads are JSON only; nothing read from Redis is ever unpickled or evaluated.
"""

from producers.protocol.error_codes import ErrorCode, error_code_of
from producers.protocol.job import (
    PROTOCOL_VERSION,
    ChatMessage,
    Job,
    ProtocolError,
    parse_job,
)
from producers.protocol.keys import (
    CONSUMER_GROUP,
    DEFAULT_CANCEL_TTL_S,
    DEFAULT_PREFIX,
    DEFAULT_QUEUES,
    DEFAULT_RESULT_TTL_S,
    HASH_FIELD,
    JOB_FIELD,
    MAX_ID_LENGTH,
    JobField,
    Keys,
    check_job_id,
    check_queue_name,
    entry_ref,
    new_job_id,
)
from producers.protocol.limits import LIMITS
from producers.protocol.schemas import (
    Completion,
    JobResult,
    JobStatus,
    Timings,
    TokenDelta,
    TokenLogprob,
    TokenText,
    TopLogprobs,
    Usage,
    WorkerInfo,
)
from producers.protocol.revisions import PROTOCOL_REVISION, Need, job_needs
from producers.protocol.score import ContinuationScore, Score
from producers.protocol.scripts import CANCEL_SCRIPT, SUBMIT_SCRIPT, cancel_keys, submit_keys
from producers.protocol.statuses import LIVE_STATUSES, TERMINAL_STATUSES, Status
from producers.protocol.validation_errors import describe_validation_error

__all__ = [
    "CANCEL_SCRIPT", "CONSUMER_GROUP", "DEFAULT_CANCEL_TTL_S", "DEFAULT_PREFIX", "DEFAULT_QUEUES",
    "DEFAULT_RESULT_TTL_S", "HASH_FIELD", "JOB_FIELD", "LIMITS", "LIVE_STATUSES", "MAX_ID_LENGTH",
    "PROTOCOL_REVISION", "PROTOCOL_VERSION",
    "SUBMIT_SCRIPT", "TERMINAL_STATUSES", "ChatMessage", "ErrorCode", "Completion", "Job", "JobField", "JobResult",
    "JobStatus", "Keys", "Need", "ProtocolError", "Status", "Timings", "TokenDelta", "Usage", "WorkerInfo",
    "ContinuationScore", "Score", "TokenLogprob", "TokenText", "TopLogprobs",
    "cancel_keys", "check_job_id", "error_code_of", "check_queue_name", "describe_validation_error", "entry_ref",
    "job_needs", "new_job_id", "parse_job", "submit_keys",
]
