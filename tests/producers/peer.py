"""The worker's half of protocol v1, played by hand, for tests that run without a worker."""

from __future__ import annotations

import threading
import time

import redis

from producers.protocol import JobField, JobResult, Keys, Status, TokenDelta, parse_job


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

    def wait_blocked(self, count: int = 1, timeout: float = 20.0) -> None:
        """Return once ``count`` clients are blocked in Redis (e.g. waiting on a done signal)."""
        deadline = time.monotonic() + timeout
        while self.blocked_clients() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} clients blocked after {timeout}s")
            time.sleep(0.005)

    def close(self) -> None:
        self.redis.close()


class HandWorker:
    """A thread that plays a worker on one queue: finishes each batch of entries it reads in
    reverse order (so results arrive out of order). A job whose metadata has ``"fail"`` fails."""

    def __init__(self, url: str, queue: str = "bulk", prefix: str = "sluiceway") -> None:
        self.peer = Peer(url, prefix)
        self.queue = queue
        self.seen = 0
        self.finished = 0
        self.max_outstanding = 0
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HandWorker":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.peer.close()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # surfaced by __exit__, not lost in a thread
            self.error = exc

    def _serve(self) -> None:
        last = "0-0"
        key = self.peer.keys.queue(self.queue)
        while not self._stop.is_set():
            reply = self.peer.redis.xread({key: last}, block=50)
            for _, entries in reply or ():
                jobs = [parse_job(fields["job"]) for _, fields in entries]
                last = entries[-1][0]
                self.seen += len(jobs)
                self.max_outstanding = max(self.max_outstanding, self.seen - self.finished)
                for job in reversed(jobs):
                    self.peer.start(job.id)
                    if job.metadata.get("fail") or (job.prompt or "").startswith("fail"):
                        self.peer.finish(job.id, Status.FAILED, error="model error: CUDA out of memory")
                    else:
                        prompt = job.prompt if job.prompt is not None else job.messages[-1].content if job.messages else ""
                        self.peer.finish(job.id, result=result_for(job.id, prompt.upper(), job.metadata))
                    self.finished += 1
