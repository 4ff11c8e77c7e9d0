"""The batch feeder in process, on a private redis-server: which batches a gateway leaves to another.

NOTE: in process rather than through gateway processes: a test needs to know which of two
gateways took the lease first, and a gateway process costs ~2 s to start."""

import asyncio
import io
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from gateway import batch_feeder
from gateway.batch_lines import job_ids_of
from gateway.batch_service import BatchService
from gateway.batch_settings import BatchSettings
from gateway.batch_records import DIRECTORY
from gateway.models import ModelDirectory
from producers.connection import connect_async
from producers.protocol import Keys
from producers.protocol.batch_keys import BatchKeys

KEYS, BATCH_KEYS = Keys(), BatchKeys()


async def until(predicate: Callable[[], Awaitable[object]], timeout: float = 20.0, what: str = "condition") -> object:
    """Await ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
    return value


async def add_batch(service: BatchService, tenant: str, input_file_id: str) -> str:
    """A batch written as ``POST /v1/batches`` writes it (gateway/batches.py); its id."""
    batch_id, now = "batch_feeder_test", time.time()
    await service.redis.hset(BATCH_KEYS.batch(batch_id), mapping={
        "id": batch_id, "tenant": tenant, "status": "validating", "endpoint": "/v1/chat/completions",
        "input_file_id": input_file_id, "completion_window": "24h", "created_at": now, "expires_at": now + 3600,
        "total": 0, "completed": 0, "failed": 0, "metadata": "", "output_expires_after": ""})
    await service.redis.sadd(BATCH_KEYS.active, batch_id)
    return batch_id


def test_a_gateway_without_files_dir_leaves_a_batch_whose_input_is_there_to_one_with_it(redis_server, tmp_path,
                                                                                        monkeypatch):
    # NOTE: should a task outlive its stop's cancels, the test goes on after 0.3 s rather than 5
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 0.3)
    line = json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}) + "\n"

    async def run() -> None:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), KEYS, 1.0)
        plain = BatchService(redis_server, KEYS.prefix, models, BatchSettings(poll_seconds=0.05, lease_seconds=60))
        with_dir = BatchService(redis_server, KEYS.prefix, models, BatchSettings(
            poll_seconds=0.05, files_dir=str(tmp_path), max_file_bytes=1))  # every upload goes to the directory
        try:
            upload = await with_dir.store.put_upload("alice", "in.jsonl", "batch", io.BytesIO(line.encode()))
            assert await plain.redis.hget(BATCH_KEYS.file(upload["id"]), "storage") == DIRECTORY
            batch_id = await add_batch(plain, "alice", upload["id"])
            await plain.start()

            async def left() -> bool:  # released, not left to its TTL (60 s)
                return batch_id in plain.feeder._refused and await plain.redis.get(BATCH_KEYS.lease(batch_id)) is None

            # was: it held the lease, renewed each pass, and failed each pass on a 503 files_dir_not_set
            await until(left, what="the gateway without files_dir to leave the batch")
            assert await plain.redis.hget(BATCH_KEYS.batch(batch_id), "status") == "validating"
            await with_dir.start()

            async def in_progress() -> bool:
                return await plain.redis.hget(BATCH_KEYS.batch(batch_id), "status") == "in_progress"

            await until(in_progress, what="the gateway with files_dir to validate the batch")
            assert await plain.redis.get(BATCH_KEYS.lease(batch_id)) == with_dir.feeder.holder
        finally:
            for service in (plain, with_dir):
                await service.close()
            await models.redis.aclose()

    asyncio.run(run())


def test_a_batch_record_that_is_not_whole_leaves_the_active_set_rather_than_failing_each_pass(redis_server, caplog,
                                                                                              monkeypatch):
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 0.3)

    async def run() -> None:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), KEYS, 1.0)
        service = BatchService(redis_server, KEYS.prefix, models, BatchSettings(poll_seconds=0.05, lease_seconds=60))
        try:
            batch_id = await add_batch(service, "alice", "file-none")
            await service.redis.hset(BATCH_KEYS.batch(batch_id), "status", "in_progress")
            await service.redis.hdel(BATCH_KEYS.batch(batch_id), "expires_at")  # as retrieve answers it: 404
            await service.start()

            async def gone() -> bool:
                return (not await service.redis.sismember(BATCH_KEYS.active, batch_id)
                        and await service.redis.get(BATCH_KEYS.lease(batch_id)) is None)

            # was: it held the lease and failed each pass on meta["expires_at"], a traceback a pass
            await until(gone, what="the feeder to drop the batch from the active set")
            assert await service.redis.hget(BATCH_KEYS.batch(batch_id), "status") == "in_progress"  # left as it was
        finally:
            await service.close()
            await models.redis.aclose()

    with caplog.at_level("ERROR", logger=batch_feeder.log.name):
        asyncio.run(run())
    assert "its record is not whole" in caplog.text and "feeder stopped" not in caplog.text


def test_a_refused_batch_is_forgotten_once_it_leaves_the_active_set_and_logged_once_while_in_it(redis_server, caplog,
                                                                                               monkeypatch):
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 0.3)

    async def run() -> None:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), KEYS, 1.0)
        plain = BatchService(redis_server, KEYS.prefix, models, BatchSettings(poll_seconds=0.02, lease_seconds=60))
        try:
            batch_id = await add_batch(plain, "alice", "file-none")
            await plain.redis.hset(BATCH_KEYS.batch(batch_id), mapping={"status": "in_progress", "answers": "dir"})

            async def refused() -> bool:
                return batch_id in plain.feeder._refused

            async def forgotten() -> bool:
                return not plain.feeder._refused

            await plain.start()
            await until(refused, what="the batch refused")
            await asyncio.sleep(0.1)  # NOTE: not a wait: five passes that skip it, each silent
            await plain.redis.srem(BATCH_KEYS.active, batch_id)  # as a gateway with files_dir ends it
            # was: remembered for good, one entry a batch refused in the gateway's life
            await until(forgotten, timeout=2, what="the batch forgotten")
        finally:
            await plain.close()
            await models.redis.aclose()

    with caplog.at_level("ERROR", logger=batch_feeder.log.name):
        asyncio.run(run())
    assert caplog.text.count("left to others") == 1


def test_a_batch_whose_input_was_deleted_under_it_drops_the_batch_field_its_create_wrote_back(redis_server,
                                                                                              monkeypatch):
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 0.3)

    async def run() -> None:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), KEYS, 1.0)
        service = BatchService(redis_server, KEYS.prefix, models, BatchSettings(poll_seconds=0.02, lease_seconds=60))
        try:
            batch_id = await add_batch(service, "alice", "file-deleted")
            await service.redis.hset(BATCH_KEYS.file("file-deleted"), "batch", batch_id)  # the create's, after the delete
            await service.start()

            async def failed() -> bool:
                return await service.redis.hget(BATCH_KEYS.batch(batch_id), "status") == "failed"

            await until(failed, what="the batch to fail at validating")
            assert not await service.redis.exists(BATCH_KEYS.file("file-deleted"))  # was left for good
        finally:
            await service.close()
            await models.redis.aclose()

    asyncio.run(run())


def test_the_other_jobs_of_a_line_whose_prompt_failed_are_cancelled_once_not_each_pass(redis_server):
    async def run() -> None:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), KEYS, 1.0)
        service = BatchService(redis_server, KEYS.prefix, models, BatchSettings())
        lines, redis = service.feeder.lines, service.redis
        try:
            batch_id = await add_batch(service, "alice", "file-none")
            meta = await redis.hgetall(BATCH_KEYS.batch(batch_id))
            failed, *others = job_ids_of(batch_id, 0, 3)
            entry = json.dumps({"l": 0, "c": "several", "q": "bulk", "o": 0, "n": 1, "k": 3})
            await redis.hset(BATCH_KEYS.pending(batch_id), mapping={job_id: entry for job_id in (failed, *others)})
            await redis.hset(KEYS.job(failed), mapping={"status": "failed", "error": "too long",
                                                        "error_code": "context_length_exceeded"})
            for job_id in others:
                await redis.hset(KEYS.job(job_id), "status", "running")
            sent = Counter()
            for _ in range(4):  # the feeder's passes while the worker has not seen the cancels yet
                assert await lines.collect(batch_id, meta) == 0
                for job_id in others:
                    sent[job_id] += await redis.delete(KEYS.cancel(job_id))  # the cancel each pass sets
            assert sent == {job_id: 1 for job_id in others}  # was 4 each: one a pass until the jobs ended
            for job_id in others:
                await redis.hset(KEYS.job(job_id), mapping={"status": "cancelled", "error_code": "cancelled"})
            assert await lines.collect(batch_id, meta) == 1
            assert not lines._cancelled.get(batch_id)  # the line answered: nothing of it is remembered
        finally:
            await service.close()
            await models.redis.aclose()

    asyncio.run(run())
