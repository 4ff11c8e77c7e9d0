"""The worker's half of protocol v1, played by hand, for tests that run without a worker."""

from __future__ import annotations

import time

import redis

from producers.protocol import JobField, JobResult, Keys, Status, TokenDelta


def result_for(job_id: str, text: str = "Paris.", metadata: dict | None = None) -> JobResult:
    return JobResult.model_validate(
        {
            "id": job_id,
            "text": text,
            "outputs": [{"text": text, "token_ids": [1, 2, 3], "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3},
            "metadata": metadata or {},
        }
    )


class Peer:
    """Moves jobs through their life cycle the way a worker does."""

    def __init__(self, url: str, prefix: str = "sluiceway") -> None:
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self.keys = Keys(prefix)

    def start(self, job_id: str, worker: str = "peer-1") -> None:
        self.redis.hset(
            self.keys.job(job_id),
            mapping={JobField.STATUS: Status.RUNNING.value, JobField.WORKER: worker, JobField.STARTED_AT: time.time()},
        )
        self.redis.hincrby(self.keys.job(job_id), JobField.ATTEMPTS, 1)

    def finish(
        self, job_id: str, status: Status = Status.DONE, *, result: JobResult | None = None, error: str | None = None
    ) -> None:
        fields = {JobField.STATUS: status.value, JobField.FINISHED_AT: time.time()}
        if status is Status.DONE:
            fields[JobField.RESULT] = (result or result_for(job_id)).model_dump_json()
        if error is not None:
            fields[JobField.ERROR] = error
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.job(job_id), mapping=fields)
            pipe.rpush(self.keys.done(job_id), status.value)
            pipe.execute()

    def token(self, job_id: str, text: str, index: int = 0, finish_reason: str | None = None) -> None:
        delta = TokenDelta(index=index, text=text, token_ids=[len(text)], finish_reason=finish_reason)
        self.redis.xadd(self.keys.tokens(job_id), delta.to_fields())

    def blocked_clients(self) -> int:
        return int(self.redis.info("clients")["blocked_clients"])

    def wait_blocked(self, count: int = 1, timeout: float = 5.0) -> None:
        """Return once ``count`` clients are blocked in Redis (e.g. waiting on a done signal)."""
        deadline = time.monotonic() + timeout
        while self.blocked_clients() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} clients blocked after {timeout}s")
            time.sleep(0.005)

    def close(self) -> None:
        self.redis.close()
