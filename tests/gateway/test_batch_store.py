"""The Batch API's store in process, on a private redis-server: what its settings change."""

import asyncio
import io

from gateway.batch_settings import BatchSettings
from gateway.batch_store import Store
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
