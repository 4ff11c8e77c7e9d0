"""The Batch API's answers and its rarer paths, against real gateway processes and a real
worker on the tiny model: answers written to the files directory as rows end (Redis holds
none), a dead holder's bytes cut off on takeover, the row limit without a directory, a cancel
while validating, a gateway killed while finalizing, and a window that ends on running jobs.

NOTE: its own stack (not test_batches.py's), so that each test's gateways are the only ones
that may take its batches' leases."""

from __future__ import annotations

import json
import signal

import pytest

from gateway.batch_records import output_file_id
from producers.protocol.batch_keys import BatchKeys
from tests.gateway.batch_stack import KEYS, PARKED, BatchStack
from tests.gateway.test_batches import chat_line, finished, lines_of, upload
from tests.worker.conftest import tiny_model, wait_for  # noqa: F401  (the session's tiny model)

BATCH_KEYS = BatchKeys()


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):  # noqa: F811
    running = BatchStack(tiny_model, tmp_path_factory.mktemp("recovery"))
    yield running
    running.close()


@pytest.fixture(autouse=True)
def own_gateways(stack):
    """Each test's gateways are gone after it, even when it fails: none takes the next one's batches."""
    yield
    for gateway in stack.gateways:
        if gateway.proc.poll() is None:
            gateway.stop(signal.SIGKILL)


def holder_of(stack: BatchStack, batch_id: str, gateways: list):
    holder = wait_for(lambda: stack.r.get(BATCH_KEYS.lease(batch_id)), timeout=30, what="a lease holder")
    return next(g for g in gateways if holder.split(":")[1] == str(g.proc.pid))


def test_rows_go_to_the_file_as_they_are_answered_and_a_takeover_cuts_a_dead_holders_bytes(stack, tmp_path):
    files_dir = tmp_path / "files"
    env = {"SLUICEWAY_BATCH_FILES_DIR": str(files_dir), "SLUICEWAY_BATCH_MAX_OUTSTANDING": "4"}
    pair = [stack.gateway(**env) for _ in range(2)]
    client = pair[0].client()
    rows = [chat_line(f"f-{i}", f"file {i}", max_tokens=2, ignore_eos=True) for i in range(160)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20, timeout=120,
             what="20 rows done")
    killed = holder_of(stack, batch.id, pair)
    killed.stop(signal.SIGKILL)
    survivor = next(g for g in pair if g is not killed)
    path = files_dir / output_file_id(batch.id, "output")
    recorded = int(stack.r.hget(BATCH_KEYS.batch(batch.id), "output_bytes"))
    answered = [json.loads(x) for x in path.read_bytes()[:recorded].splitlines()]
    # mid-batch the answered rows are in the file, and no line of them is in Redis
    assert len(answered) == int(stack.r.hget(BATCH_KEYS.batch(batch.id), "completed")) >= 20
    assert stack.r.llen(BATCH_KEYS.output(batch.id)) == 0
    with path.open("ab") as f:  # what a holder killed between its append and its record leaves
        f.write(json.dumps(answered[0]).encode() + b'\n{"id": "batch_req_cut", "custom_id": "f-1", "resp')
    done = finished(survivor.client(), batch.id)
    assert done.status == "completed" and done.request_counts.completed == 160
    out = lines_of(survivor.client(), done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"f-{i}" for i in range(160))  # each exactly once
    assert survivor.client().files.retrieve(done.output_file_id).bytes == path.stat().st_size
    assert stack.r.llen(BATCH_KEYS.output(batch.id)) == 0
    survivor.stop()


def test_without_a_files_dir_a_file_over_the_row_limit_fails_at_validating_naming_it(stack):
    gateway = stack.gateway(SLUICEWAY_BATCH_MAX_ROWS_IN_REDIS="3")
    client = gateway.client()
    rows = [chat_line(f"r-{i}", "row") for i in range(5)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = finished(client, batch.id, timeout=60)
    assert done.status == "failed" and done.errors.data[0].code == "too_many_rows"
    message = done.errors.data[0].message
    assert "has 5 rows" in message and "the limit is 3 rows (SLUICEWAY_BATCH_MAX_ROWS_IN_REDIS)" in message
    assert "FILES_DIR" in message
    ok = client.batches.create(input_file_id=upload(client, rows[:3]), endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert finished(client, ok.id).request_counts.completed == 3
    gateway.stop()


def test_a_cancel_while_validating_ends_cancelled_with_nothing_run(stack):
    # A gateway that scans once, at its start: the batch it creates waits in validating.
    idle = stack.gateway(SLUICEWAY_BATCH_POLL_SECONDS="600")
    client = idle.client()
    batch = client.batches.create(input_file_id=upload(client, [chat_line(f"v-{i}", "x") for i in range(4)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    assert client.batches.cancel(batch.id).cancelling_at == cancelling.cancelling_at  # a retry while cancelling: 200
    feeder = stack.gateway()  # takes the batch over
    done = finished(client, batch.id, timeout=60)
    assert done.status == "cancelled" and done.cancelled_at and done.in_progress_at is None
    assert done.request_counts.completed == done.request_counts.failed == 0
    assert done.output_file_id is None and done.error_file_id is None
    assert not [e for e in stack.r.xrange(KEYS.queue("bulk")) if batch.id in e[1]["job"]]
    wait_for(lambda: not stack.r.sismember(BATCH_KEYS.active, batch.id), timeout=30, what="the batch cleaned up")
    for gateway in (idle, feeder):
        gateway.stop()


def test_a_gateway_killed_while_finalizing_an_expired_batch_another_finishes_it(stack, tmp_path):
    """Finalizing an expired batch writes an error line for every row never fed: with 6,000 of
    them the kill lands mid-way, and the next holder answers the rest, each row once."""
    env = {"SLUICEWAY_BATCH_FILES_DIR": str(tmp_path / "files"), "SLUICEWAY_BATCH_MAX_OUTSTANDING": "2"}
    pair = [stack.gateway(**env) for _ in range(2)]
    client = pair[0].client()
    rows = [chat_line(f"x-{i}", "parked", model=PARKED) for i in range(6000)]  # nobody reads the parked queue
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="3s")
    key = BATCH_KEYS.batch(batch.id)
    wait_for(lambda: stack.r.hget(key, "status") == "finalizing", timeout=60, what="finalizing")
    killed = holder_of(stack, batch.id, pair)
    killed.stop(signal.SIGKILL)
    assert int(stack.r.hget(key, "failed") or 0) < 6000, "the kill lands mid-finalizing"
    survivor = next(g for g in pair if g is not killed)
    done = finished(survivor.client(), batch.id, timeout=120)
    assert done.status == "expired" and done.request_counts.failed == 6000 and done.request_counts.completed == 0
    err = lines_of(survivor.client(), done.error_file_id)
    assert sorted(r["custom_id"] for r in err) == sorted(f"x-{i}" for i in range(6000))
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    assert stack.r.xlen(KEYS.queue(PARKED)) == 0
    survivor.stop()


def test_a_window_that_ends_on_running_jobs_answers_each_row_once(stack):
    """Without a files directory: 8 rows running when the window ends, the rest never fed; the error
    file's size is that of its lines (it missed the lines written while finalizing)."""
    gateway = stack.gateway(SLUICEWAY_BATCH_MAX_OUTSTANDING="8")
    client = gateway.client()
    rows = [chat_line(f"w-{i}", f"long {i}", max_tokens=480, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="2s")
    wait_for(lambda: any(stack.r.hget(KEYS.job(f"{batch.id}-{n}"), "status") == "running" for n in range(1, 41)),
             timeout=30, what="a row running")
    done = finished(client, batch.id, timeout=120)
    assert done.status == "expired" and done.expired_at
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"w-{i}" for i in range(40))
    assert {r["error"]["code"] for r in err} == {"batch_expired"} and len(err) == done.request_counts.failed
    assert len(out) == done.request_counts.completed < 40
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id is not None:
            assert client.files.retrieve(file_id).bytes == len(client.files.content(file_id).content)
    assert not [k for k in stack.r.scan_iter(KEYS.job(f"{batch.id}-*"))]  # no job of it is left behind
    gateway.stop()


def test_a_gateway_stopped_hands_its_batches_on_at_once(stack):
    """SIGTERM: the batch's lease is released as the gateway shuts down, not left to run out
    (10 s), and the next gateway finishes the batch."""
    gateway = stack.gateway(SLUICEWAY_BATCH_MAX_OUTSTANDING="1")
    client = gateway.client()
    rows = [chat_line(f"h-{i}", f"hand {i}", max_tokens=100, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, timeout=60, what="a row done")
    assert stack.r.get(BATCH_KEYS.lease(batch.id)) is not None
    gateway.stop()
    # released, not left to its TTL
    assert stack.r.get(BATCH_KEYS.lease(batch.id)) is None, gateway.output()[-3000:]
    assert stack.r.hget(BATCH_KEYS.batch(batch.id), "status") == "in_progress"  # handed on mid-batch
    other = stack.gateway(SLUICEWAY_BATCH_MAX_OUTSTANDING="8")
    done = finished(other.client(), batch.id, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == 40
    other.stop()
