"""What a client does when Redis cuts a wait short or refuses a submission."""

import time

import pytest
import redis

from producers.jobs import block_chunk
from producers.protocol import Keys

K = Keys("sluiceway")


def test_the_shortest_wait_chunk_never_asks_redis_to_block_forever(redis_server):
    # A wait with a sliver of time left must still come back: Redis reads a block that
    # rounds to 0 ms as "forever", which would overrun the caller by the socket timeout.
    r = redis.Redis.from_url(redis_server, socket_timeout=3)
    started = time.monotonic()
    assert r.blmove("empty", "empty", block_chunk(1e-6, None), "RIGHT", "LEFT") is None
    assert time.monotonic() - started < 1.5
    r.close()


def test_a_submission_redis_refuses_leaves_no_job_behind(client, redis_server):
    # A queue whose last entry id is the largest possible takes no new entry ('*' cannot
    # grow past it): the XADD fails, and no hash may stay behind saying "queued" forever.
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    r.xadd(K.queue("interactive"), {"job": "{}"}, id="18446744073709551615-18446744073709551615")
    with pytest.raises(redis.ResponseError, match="last possible ID"):
        client.submit("hello", job_id="refused-1")
    assert r.exists(K.job("refused-1")) == 0
    r.close()
