"""The gateway on a real Redis Cluster (``cluster_stack``: three masters, ``--queue-shards``): the
shared stream reader per hash slot, a Batch from upload to output file, the Batch API's
scripts on one slot each, and a cluster URL without the layout refused at startup. (The
completion, chat, streamed and kill -9 tests of ``test_openai`` / ``test_resilience`` run on
the cluster stack as well.)"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import click
import pytest
import redis

from gateway.batch_lines import job_id_of
from gateway.batch_settings import BatchSettings
from gateway.batch_store import Store
from gateway.cli import load_settings
from producers.aio import AsyncClient
from producers.protocol import Keys
from producers.protocol.batch_keys import BatchKeys
from tests.gateway.conftest import MODEL, SHARDS, wait_for
from tests.gateway.test_batches import chat_line, finished, lines_of, upload


READER = "reader-under-test"  # the client name of the test's own connections (the gateway reads there too)


def _blocked_xreads(stack) -> dict[str, int]:
    """Per node: the test reader's XREADs blocked there."""
    counts = {}
    for url in stack.cluster.urls:
        with redis.Redis.from_url(url, decode_responses=True) as node:
            counts[url] = sum(c["cmd"] == "xread" and "b" in c["flags"] and c["name"] == READER
                              for c in node.client_list())
    return counts


def _id_in_shard(keys: Keys, shard: int, stem: str) -> str:
    return next(f"{stem}-{i}" for i in range(10_000) if keys.shard_of(f"{stem}-{i}") == shard)


def test_the_shared_reader_sends_one_xread_per_slot_and_a_new_stream_wakes_its_node(cluster_stack):
    stack, keys = cluster_stack, cluster_stack.keys
    names = [keys.tokens(_id_in_shard(keys, shard, "reader")) for shard in range(SHARDS)]

    async def main() -> None:
        client = AsyncClient(stack.redis_url, queue_shards=SHARDS, shared_streams=True, socket_timeout=120,
                             client_name=READER)
        reader = client.streams
        tails = [reader.follow(name) for name in names]
        for i, name in enumerate(names):
            await client.redis.xadd(name, {"n": str(i)})
        for i, tail in enumerate(tails):  # streams of four slots (on more than one node), no CROSSSLOT
            assert [fields for _, fields in await reader.take(tail, 10)] == [{"n": str(i)}]
        await asyncio.to_thread(wait_for, lambda: sum(_blocked_xreads(stack).values()) == SHARDS, 10,
                                "one blocked XREAD per slot")
        assert sum(1 for n in _blocked_xreads(stack).values() if n) >= 2  # the lanes are on different nodes
        late = reader.follow(keys.tokens(_id_in_shard(keys, 1, "late")))  # a slot blocked for 60 s: woken
        await client.redis.xadd(late.key, {"n": "late"})
        started = time.monotonic()
        assert [fields for _, fields in await reader.take(late, 30)] == [{"n": "late"}]
        assert time.monotonic() - started < 10, "the new stream waited for its slot's blocked read"
        assert reader.commands < 4 * SHARDS, f"{reader.commands} XREADs"
        started = time.monotonic()
        await client.close()  # ends every lane's blocked read at once
        assert time.monotonic() - started < 5
        await asyncio.to_thread(wait_for, lambda: not any(_blocked_xreads(stack).values()), 10, "the reads gone")

    asyncio.run(main())


def test_a_small_batch_runs_from_upload_to_output_file_on_the_cluster(cluster_stack):
    client = cluster_stack.gateway.client()
    rows = [chat_line(f"c-{i}", f"cluster row {i}", max_tokens=3, ignore_eos=True, temperature=0) for i in range(4)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = finished(client, batch.id, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == 4 and done.request_counts.failed == 0
    out = {line["custom_id"]: line["response"] for line in lines_of(client, done.output_file_id)}
    assert sorted(out) == [f"c-{i}" for i in range(4)] and {r["status_code"] for r in out.values()} == {200}
    direct = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "cluster row 2"}],
                                            max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out["c-2"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    batch_keys = BatchKeys()
    wait_for(lambda: not cluster_stack.r.sismember(batch_keys.active, batch.id), timeout=30, what="the batch cleaned")
    assert cluster_stack.r.get(batch_keys.lease(batch.id)) is None


def test_every_batch_script_s_keys_share_one_slot_and_the_names_stay():
    store = Store(None, None, "sluiceway", BatchSettings(), SHARDS)
    keys, jobs = store.keys, store.jobs
    assert jobs.shards == SHARDS  # a batch's jobs are submitted in the cluster layout
    for batch_id in (f"batch_{i:032x}" for i in range(20)):
        calls = ([keys.batch(batch_id), keys.answered(batch_id), keys.pending(batch_id), keys.output(batch_id)],
                 [keys.batch(batch_id), keys.answered(batch_id), keys.pending(batch_id), keys.errors(batch_id)],
                 [keys.batch(batch_id), keys.answered(batch_id), keys.pending(batch_id), keys.lease(batch_id)],
                 [keys.pending(batch_id), keys.answered(batch_id), keys.duplicates(batch_id), keys.lease(batch_id)])
        for names in calls:  # ANSWER_LINE, RECORD_ANSWERS (x2) and the clean-up's DEL
            assert len({redis.crc.key_slot(k.encode()) for k in names}) == 1, names
        line_job = job_id_of(batch_id, 7)
        names = [jobs.job(line_job), jobs.done(line_job), jobs.tokens(line_job)]  # the collect's DEL
        assert len({redis.crc.key_slot(k.encode()) for k in names}) == 1, names
    file_id = "file-" + "a" * 32
    assert redis.crc.key_slot(keys.file(file_id).encode()) == redis.crc.key_slot(keys.file_data(file_id).encode())
    assert (keys.batch("b"), keys.lease("b"), keys.file("f"), keys.files("t"), keys.active) == (
        "sluiceway:batch:{b}", "sluiceway:batch:{b}:lease", "sluiceway:file:{f}", "sluiceway:files:tenant:t",
        "sluiceway:batches:active")  # the single-node names, unchanged


def test_a_cluster_url_without_queue_shards_is_one_clear_error_at_startup(monkeypatch):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    proc = subprocess.run([sys.executable, "-m", "gateway", "--redis", "redis+cluster://127.0.0.1:1,127.0.0.1:2"],
                          env=environ, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("error: redis: a Redis Cluster needs the cluster layout: give queue_shards=N "
                                   "(--queue-shards N, the workers' --queue-shards; PROTOCOL.md, 'The cluster "
                                   "layout')")
    monkeypatch.setenv("SLUICEWAY_QUEUE_SHARDS", "4")  # the worker's variable, the same meaning
    assert load_settings({}).keys.shards == 4
    with pytest.raises(click.UsageError, match=r"--queue-shards \(env SLUICEWAY_QUEUE_SHARDS\): Input should be "
                                               r"less than or equal to 1024"):
        load_settings({"queue_shards": 5000})


def test_a_cluster_node_reached_by_a_single_node_url_is_one_clear_error_at_startup(cluster_stack):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--redis", cluster_stack.cluster.urls[0],
                             "--queue-shards", str(SHARDS), "--port", "0"], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err[-2000:]
    assert err.strip().endswith("error: redis: the server is a Redis Cluster node reached by a single-node URL; "
                                "give redis+cluster://host:port[,host:port...] and --queue-shards N")
