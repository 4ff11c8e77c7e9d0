"""The Batch API's store in process, on a private redis-server: what its settings change."""

import asyncio
import io

import pytest

from gateway.batch_records import output_file_id
from gateway.batch_settings import BatchSettings
from gateway.batch_store import Store
from gateway.errors import APIError
from gateway.file_removal import FileRemoval
from producers.connection import connect_async
from producers.protocol import Keys
from producers.protocol.batch_keys import BatchKeys

BATCH_KEYS = BatchKeys()


def test_the_default_expiry_of_an_upload_is_a_setting_and_0_keeps_it(redis_server, monkeypatch):
    monkeypatch.setenv("SLUICEWAY_BATCH_DEFAULT_EXPIRES_AFTER", "7200")

    async def run() -> None:
        redis = connect_async(redis_server, decode_responses=True)
        raw = connect_async(redis_server, decode_responses=False)

        async def upload(settings: BatchSettings, expires_after: int | None = None) -> dict:
            store = Store(redis, raw, Keys().prefix, settings)
            return await store.put_upload("alice", "in.jsonl", "batch", io.BytesIO(b'{"a": 1}\n'), expires_after)

        try:
            default = await upload(BatchSettings())  # read from the environment
            assert default["expires_at"] == default["created_at"] + 7200
            given = await upload(BatchSettings(), 3600)  # the upload's own expires_after wins
            assert given["expires_at"] == given["created_at"] + 3600
            kept = await upload(BatchSettings(default_expires_after=0))
            assert kept["expires_at"] is None
            expiring = await redis.zrange(BATCH_KEYS.expiring_files, 0, -1)
            assert sorted(expiring) == sorted([default["id"], given["id"]])  # nothing for the sweep of the kept one
        finally:
            for client in (redis, raw):
                await client.aclose()

    asyncio.run(run())


def test_a_file_hash_holding_only_a_batch_field_is_deleted_by_that_batchs_tenant(redis_server):
    """What a batch create racing the file's delete leaves: no index names it, so it was a 404 for good."""

    async def run() -> None:
        redis = connect_async(redis_server, decode_responses=True)
        raw = connect_async(redis_server, decode_responses=False)
        store = Store(redis, raw, Keys().prefix, BatchSettings())
        removal = FileRemoval(store)
        try:
            await redis.hset(BATCH_KEYS.batch("batch_raced"), mapping={"id": "batch_raced", "tenant": "alice"})
            await redis.hset(BATCH_KEYS.file("file-raced"), "batch", "batch_raced")
            for file_id, tenant in (("file-raced", "bob"), ("file-other", "alice")):
                with pytest.raises(APIError, match="No such File object"):  # another tenant's batch, or no hash
                    await removal.delete_file(tenant, file_id)
            assert (await removal.delete_file("alice", "file-raced"))["deleted"]  # was a 404
            assert not await redis.exists(BATCH_KEYS.file("file-raced"))
            assert await redis.exists(BATCH_KEYS.batch("batch_raced"))
        finally:
            for client in (redis, raw):
                await client.aclose()

    asyncio.run(run())


def test_a_file_delete_deletes_the_list_its_id_derives_never_the_key_its_lines_field_names(redis_server):
    async def run() -> None:
        redis = connect_async(redis_server, decode_responses=True)
        raw = connect_async(redis_server, decode_responses=False)
        store = Store(redis, raw, Keys().prefix, BatchSettings())
        removal = FileRemoval(store)
        queue, answers = Keys().queue("bulk"), BATCH_KEYS.output("batch_other")
        try:
            await redis.xadd(queue, {"job": "{}"})
            await redis.rpush(answers, "another batch's answer\n")
            output = output_file_id("batch_done", "output")
            await redis.rpush(BATCH_KEYS.output("batch_done"), "its answer\n")
            await store.put_lines("alice", output, "out.jsonl", BATCH_KEYS.output("batch_done"), 11)
            assert (await removal.delete_file("alice", output))["deleted"]
            assert not await redis.exists(BATCH_KEYS.output("batch_done"))  # a batch's own list goes with its file
            for victim in (queue, answers):  # a hash written by hand, whole or a part of one, naming another key
                for broken in ({}, {"bytes": "many"}):
                    await store.put_lines("alice", "file-hand", "h.jsonl", victim, 1)
                    if broken:
                        await redis.hset(BATCH_KEYS.file("file-hand"), mapping=broken)
                    assert (await removal.delete_file("alice", "file-hand"))["deleted"]
                    assert not await redis.exists(BATCH_KEYS.file("file-hand"))
                    assert await redis.exists(victim), (victim, broken)  # was deleted
        finally:
            for client in (redis, raw):
                await client.aclose()

    asyncio.run(run())


def test_a_batch_that_has_ended_holds_its_input_no_longer_though_still_in_the_active_set(redis_server):
    """Between the status a retrieve reads as the end and its feeder's clean-up at its next pass."""

    async def run() -> None:
        redis = connect_async(redis_server, decode_responses=True)
        raw = connect_async(redis_server, decode_responses=False)
        store = Store(redis, raw, Keys().prefix, BatchSettings())
        removal = FileRemoval(store)
        try:
            for batch_id, status in (("batch_running", "in_progress"), ("batch_ended", "cancelled")):
                await redis.hset(BATCH_KEYS.batch(batch_id), mapping={"input_file_id": f"file-{status}",
                                                                      "status": status})
                await redis.sadd(BATCH_KEYS.active, batch_id)
            assert await removal.running_batch_of("file-in_progress") == "batch_running"
            assert await removal.running_batch_of("file-cancelled") is None  # was batch_ended: a delete was a 409
        finally:
            for client in (redis, raw):
                await client.aclose()

    asyncio.run(run())
