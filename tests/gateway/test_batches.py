"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``) through the official SDK, against real
gateway processes and a real worker on the tiny model: bad lines, a gateway killed with
SIGKILL mid-batch, cancel, expiry, limits and two tenants that cannot see each other."""

from __future__ import annotations

import io
import json
import re
import secrets
import signal
import subprocess
import sys
import time

import openai
import pytest

from producers.protocol.batch_keys import BatchKeys
from tests.gateway.batch_stack import ALICE, BOB, KEYS, MODEL, PARKED, BatchStack
from tests.worker.conftest import tiny_model, wait_for  # noqa: F401  (the session's tiny model)

ENDED = ("completed", "failed", "expired", "cancelled")
BATCH_KEYS = BatchKeys()
ACTIVE = "key-active"  # the key of the tenant "active", named as the active set's last segment


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):  # noqa: F811
    running = BatchStack(tiny_model, tmp_path_factory.mktemp("batch"))
    yield running
    running.close()


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batch-files")


@pytest.fixture(scope="module")
def gateway(stack, files_dir):
    """The gateway most tests use: files over 64 KiB go to a directory, not to Redis. Its tenants are
    alice, bob and active."""
    return stack.gateway("--api-key", f"active={ACTIVE}", SLUICEWAY_BATCH_MAX_FILE_BYTES=str(64 * 1024),
                         SLUICEWAY_BATCH_FILES_DIR=str(files_dir), SLUICEWAY_BATCH_MAX_DIR_FILE_BYTES=str(4 * 2**20))


def chat_line(custom_id: str, text: str, model: str = MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, **body}}


def upload(client: openai.OpenAI, lines: list) -> str:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 240):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in ENDED and b, timeout=timeout,
                    what=f"batch {batch_id} to end")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_gateway_killed_mid_batch_another_carries_on_and_answers_each_line_once(stack):
    # NOTE: first in the module, so these two are the only gateways that may take the batch.
    pair = [stack.gateway(SLUICEWAY_BATCH_MAX_OUTSTANDING="16") for _ in range(2)]
    client = pair[0].client()
    rows = [chat_line(f"k-{i}", f"kill {i}", max_tokens=2, ignore_eos=True) for i in range(200)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 30, timeout=120,
             what="30 rows done")
    holder = stack.r.get(BATCH_KEYS.lease(batch.id))
    killed = next(g for g in pair if holder.split(":")[1] == str(g.proc.pid))
    killed.stop(signal.SIGKILL)
    survivor = next(g for g in pair if g is not killed)
    assert survivor.client().batches.retrieve(batch.id).request_counts.completed < 200, "the kill lands mid-batch"
    done = finished(survivor.client(), batch.id)
    assert done.status == "completed" and done.request_counts.completed == 200 and done.request_counts.failed == 0
    out = lines_of(survivor.client(), done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"k-{i}" for i in range(200))  # each exactly once
    assert done.error_file_id is None
    assert stack.r.get(BATCH_KEYS.lease(batch.id)) is None  # released with the batch
    survivor.stop()


def test_a_thousand_rows_with_bad_lines_mixed_in(stack, gateway):
    client = gateway.client()
    rows: list = [chat_line(f"row-{i}", f"question {i}") for i in range(1000)]
    rows[10] = '{"custom_id": "row-10", "method": "POST"'  # not JSON
    rows[20] = chat_line("row-19", "again")  # row-19 is line 20's custom_id
    rows[30] = {**chat_line("row-30", "x"), "url": "/v1/embeddings"}
    rows[40] = chat_line("row-40", "x", temperature=-1)  # the gateway rejects it
    rows[50] = {**chat_line("row-50", "x"), "url": "/v1/completions"}  # not the batch's endpoint
    rows[60] = chat_line("row-60", "x", tools=[{"type": "function"}])
    rows[70] = chat_line("row-70", "x", model="no-such-model")  # no worker serves it: never another model's answer
    file_id = upload(client, rows)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "thousand"})
    assert batch.status == "validating" and batch.metadata == {"run": "thousand"}
    started = time.monotonic()
    done = finished(client, batch.id)
    elapsed = time.monotonic() - started
    assert done.status == "completed", done
    assert done.request_counts.total == 1000 and done.request_counts.completed == 993
    assert done.request_counts.failed == 7
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"row-{i}" for i in range(1000)
                                                         if i not in (10, 20, 30, 40, 50, 60, 70))
    first = next(r for r in out if r["custom_id"] == "row-0")
    assert first["response"]["status_code"] == 200 and first["error"] is None
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["message"]["role"] == "assistant"
    by_line = {r["error"]["line"]: r["error"] for r in err}
    assert sorted(by_line) == [11, 21, 31, 41, 51, 61, 71]
    assert "not valid JSON" in by_line[11]["message"]
    assert by_line[21]["code"] == "duplicate_custom_id" and "line 20" in by_line[21]["message"]
    assert "/v1/embeddings" in by_line[31]["message"]
    assert "temperature" in by_line[41]["message"]
    assert "not this batch's endpoint" in by_line[51]["message"]
    assert "tools.0.function: must be an object with a name" in by_line[61]["message"]
    assert by_line[71]["code"] == "model_not_found" and "'no-such-model' does not exist" in by_line[71]["message"]
    # Everything the batch left in Redis is its object and its two files: no job keys, no pending.
    assert not stack.r.exists(KEYS.job(f"{batch.id}-1")) and not stack.r.sismember(
        BATCH_KEYS.active, batch.id)
    print(f"1000-row batch: {elapsed:.1f}s")


def test_not_jsonl_fails_at_validating_with_the_reason(gateway):
    client = gateway.client()
    file_id = client.files.create(file=("x.jsonl", io.BytesIO(b"\x89PNG\r\n binary stuff\n")), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert "not JSONL" in done.errors.data[0].message and "line 1" in done.errors.data[0].message


def test_a_line_nested_past_pythons_own_limit_is_an_error_line_and_the_batch_ends(gateway):
    client = gateway.client()
    deep = '{"custom_id": "deep", "body": ' + "[" * 50_000 + "]" * 50_000 + "}"  # json.loads: RecursionError
    batch = client.batches.create(input_file_id=upload(client, [chat_line("ok", "fine"), deep]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(client, batch.id, timeout=60)  # was: validating for ever, the feeder failing each pass
    assert done.status == "completed" and done.request_counts.completed == 1 and done.request_counts.failed == 1
    [error] = lines_of(client, done.error_file_id)
    assert error["error"]["line"] == 2 and "nested 50,001 levels deep; the limit is 64" in error["error"]["message"]
    only_deep = client.batches.create(input_file_id=upload(client, [deep]), endpoint="/v1/chat/completions",
                                      completion_window="24h")
    failed = finished(client, only_deep.id, timeout=60)
    assert failed.status == "failed" and "line 1: not valid JSON" in failed.errors.data[0].message


def test_cancel_mid_batch_stops_feeding_and_keeps_the_finished_rows(stack, gateway):
    client = gateway.client()
    rows = [chat_line(f"c-{i}", f"cancel {i}", max_tokens=30, ignore_eos=True) for i in range(400)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5, timeout=120, what="5 rows done")
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    assert done.finalizing_at is None  # was set: cancelling went through finalizing, which OpenAI's never does
    out = lines_of(client, done.output_file_id)
    assert 5 <= len(out) == done.request_counts.completed < 400
    assert len({r["custom_id"] for r in out}) == len(out)
    assert stack.r.xlen(KEYS.queue("bulk")) == 0  # no job of it is left waiting
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch with status 'cancelled'"):
        client.batches.cancel(batch.id)  # as OpenAI answers it; was 200 with the batch as it was


def test_a_batch_past_its_window_expires_with_unrun_rows_in_the_error_file(stack, gateway):
    client = gateway.client()
    rows = [chat_line(f"e-{i}", "wait", model=PARKED) for i in range(5)]  # nobody reads the parked queue
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="2s")
    done = finished(client, batch.id, timeout=60)
    assert done.status == "expired" and done.expired_at and done.request_counts.failed == 5
    err = lines_of(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in err) == [f"e-{i}" for i in range(5)]
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    assert stack.r.xlen(KEYS.queue(PARKED)) == 0  # its queued jobs were cancelled


def test_tenants_cannot_see_each_others_files_or_batches(gateway):
    alice, bob = gateway.client(ALICE), gateway.client(BOB)
    older = upload(alice, [chat_line("o", "older")])
    file_id = upload(alice, [chat_line("a", "mine")])
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.files.delete(file_id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in bob.files.list()]
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert file_id in [f.id for f in alice.files.list()] and batch.id in [b.id for b in alice.batches.list()]
    page = alice.files.list(limit=1, purpose="batch")
    assert [f.id for f in page.data] == [file_id] and page.has_more  # newest first
    assert alice.files.list(after=file_id, purpose="batch").data[0].id == older
    done = finished(alice, batch.id)
    assert done.status == "completed"
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch with status 'completed'"):
        alice.batches.cancel(batch.id)
    assert alice.files.delete(done.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(done.output_file_id)
    with pytest.raises(openai.AuthenticationError):
        gateway.client("key-nobody").files.list()


def test_an_upload_over_the_limits_is_refused_naming_them(gateway):
    client = gateway.client()
    over = 4 * 2**20 + 1000  # over the directory's 4 MiB (and Redis's 64 KiB)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * over)), purpose="batch")
    assert caught.value.status_code == 413
    assert (f"is {over:,} bytes; the limit is 65,536 bytes in Redis (SLUICEWAY_BATCH_MAX_FILE_BYTES) and 4,194,304"
            " in files_dir") in caught.value.message
    with pytest.raises(openai.APIStatusError) as caught:  # refused by its Content-Length, before it is read
        client.files.create(file=("huge.jsonl", io.BytesIO(b"x" * 3 * over)), purpose="batch")
    assert caught.value.status_code == 413 and "the limit is 4,194,304 bytes" in caught.value.message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


def test_bulk_format_openai_answers_a_file_as_the_batch_api_does(stack, gateway, tmp_path):
    """The same file through ``sluiceway bulk --format openai`` and through /v1/batches, on the
    real worker: greedy, so the same response bodies (logprobs and priority included; only id
    and created differ), and the same error lines."""
    rows: list = [chat_line(f"p-{i}", f"same {i}", max_tokens=3, temperature=0) for i in range(12)]
    rows[1]["body"].update(logprobs=True, top_logprobs=2)
    rows[2]["body"].update(logprobs=True, priority=5)
    rows[4] = chat_line("p-3", "a duplicate")
    rows[7] = "not json"
    rows[9]["body"]["tools"] = [{"type": "function", "function": {"name": "f"}}]  # refused the same way
    in_path = tmp_path / "in.jsonl"
    in_path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "sluiceway", "bulk", "--format", "openai", str(in_path),
                           str(tmp_path / "out.jsonl"), "--errors", str(tmp_path / "err.jsonl"), "--redis",
                           stack.redis_url, "--no-progress"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "12 rows: 9 done, 0 failed, 3 invalid" in proc.stderr, proc.stderr
    client = gateway.client()
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = finished(client, batch.id)

    def bodies(lines):
        return {r["custom_id"]: {k: v for k, v in r["response"]["body"].items() if k not in ("id", "created")}
                for r in lines}

    cli_out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    cli, api = bodies(cli_out), bodies(lines_of(client, done.output_file_id))
    # NOTE: logprobs to 1e-3: a row's floats move in their last bits with whatever it was batched with
    assert alike(cli, api) and sorted(cli) == sorted(api) and len(cli_out) == 9
    assert len(api["p-1"]["choices"][0]["logprobs"]["content"]) == 3
    assert [len(t["top_logprobs"]) for t in api["p-1"]["choices"][0]["logprobs"]["content"]] == [2, 2, 2]
    assert api["p-2"]["choices"][0]["logprobs"]["content"] and api["p-0"]["choices"][0]["logprobs"] is None
    cli_err = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    api_err = lines_of(client, done.error_file_id)

    def errors(lines):
        return sorted((r["error"]["line"], r["error"]["code"], r["error"]["message"]) for r in lines)

    assert errors(cli_err) == errors(api_err)
    assert [e[:2] for e in errors(api_err)] == [(5, "duplicate_custom_id"), (8, "invalid_request"),
                                                 (10, "invalid_request")]


def alike(a, b) -> bool:
    """Equal, floats to within 1e-3."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-3
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(alike(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))
    return a == b


def test_a_job_redis_lost_is_submitted_again_from_its_line(stack, gateway):
    """A pending line whose job hash is gone (cut off mid-submission, or a Redis restarted
    without persistence) is submitted again from the line's bytes, under the same id."""
    client = gateway.client()
    rows = [chat_line(f"l-{i}", f"lost {i}", model=PARKED) for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    pending = BATCH_KEYS.pending(batch.id)
    wait_for(lambda: stack.r.hlen(pending) == 3, timeout=30, what="three lines in flight")
    job_id = f"{batch.id}-2"
    entry = stack.r.hget(KEYS.job(job_id), "queued_entry")
    stack.r.delete(KEYS.job(job_id))
    stack.r.xdel(KEYS.queue(PARKED), entry)
    wait_for(lambda: stack.r.hget(KEYS.job(job_id), "status") == "queued", timeout=30, what="the job submitted again")
    jobs = {job["id"]: job for _, f in stack.r.xrange(KEYS.queue(PARKED)) if (job := json.loads(f["job"]))}
    assert sorted(j for j in jobs if j.startswith(batch.id)) == [f"{batch.id}-{n}" for n in (1, 2, 3)]
    # each job expires with its batch, even were no gateway left to cancel it
    assert int(jobs[job_id]["deadline"]) == batch.expires_at
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.request_counts.completed == 0 and done.output_file_id is None
    assert not [e for e in stack.r.xrange(KEYS.queue(PARKED)) if batch.id in e[1]["job"]]


def test_the_input_of_a_running_batch_cannot_be_deleted_though_a_later_batch_on_it_ended(stack, gateway):
    client = gateway.client()
    file_id = upload(client, [chat_line(f"d-{i}", "wait", model=PARKED) for i in range(2)])  # its jobs wait
    running = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(running.id).status == "in_progress", timeout=30, what="in_progress")
    later = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.cancel(later.id).status == "cancelling"
    assert finished(client, later.id, timeout=60).status == "cancelled"
    # was: deleted, as only the file's last batch was looked at; the running one then failed
    # every pass on its missing input and never ended
    with pytest.raises(openai.ConflictError, match=f"input of batch {running.id}"):
        client.files.delete(file_id)
    client.batches.cancel(running.id)
    assert finished(client, running.id, timeout=60).status == "cancelled"
    assert client.files.delete(file_id).deleted


def add_batch(stack, tenant: str, input_file_id: str, *, active: bool = True) -> str:
    """A batch written as ``POST /v1/batches`` writes it (gateway/batches.py), on any file id; its id.
    Not ``active``: left out of the active set, so no feeder takes it."""
    batch_id, now = f"batch_{secrets.token_hex(16)}", time.time()
    stack.r.hset(BATCH_KEYS.batch(batch_id), mapping={
        "id": batch_id, "tenant": tenant, "status": "validating", "endpoint": "/v1/chat/completions",
        "input_file_id": input_file_id, "completion_window": "24h", "created_at": now, "expires_at": now + 3600,
        "total": 0, "completed": 0, "failed": 0, "metadata": "", "output_expires_after": ""})
    stack.r.zadd(BATCH_KEYS.batches(tenant), {batch_id: now})
    if active:
        stack.r.sadd(BATCH_KEYS.active, batch_id)
    return batch_id


def test_a_batch_whose_input_vanished_under_it_fails_at_validating(stack, gateway):
    """A create racing a delete: the create read the whole file, the delete removed it, and the create
    then wrote the batch and the file's ``batch`` field, the one field of its hash now."""
    client = gateway.client()
    file_id = upload(client, [chat_line("v", "gone")])
    client.files.delete(file_id)
    batch_id = add_batch(stack, "alice", file_id)
    stack.r.hset(BATCH_KEYS.file(file_id), "batch", batch_id)
    done = finished(client, batch_id, timeout=30)  # was: validating for ever, a KeyError each pass
    assert done.status == "failed" and "the input file is gone" in done.errors.data[0].message
    assert not stack.r.exists(BATCH_KEYS.file(file_id))  # was: the batch field alone, left for good


def test_a_file_record_that_is_not_whole_is_404_never_a_500(stack, gateway):
    client = gateway.client()
    file_id = upload(client, [chat_line("p", "part")])
    key = BATCH_KEYS.file(file_id)
    whole = stack.r.hgetall(key)
    calls = (lambda: client.files.retrieve(file_id), lambda: client.files.content(file_id),
             lambda: client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                           completion_window="24h"))
    for broken in ({"bytes": None}, {"bytes": "many"}, {"created_at": None}, {"expires_at": "soon"},
                   {"storage": None}, {"storage": "tape"}, {"storage": "lines"}, {"purpose": None}):
        stack.r.delete(key)
        stack.r.hset(key, mapping={k: v for k, v in {**whole, **broken}.items() if v is not None})
        for call in calls:  # was a 500 for a record without bytes (retrieve: a KeyError), or bytes not a number
            with pytest.raises(openai.NotFoundError, match="No such File object"):
                call()
        assert file_id not in [f.id for f in client.files.list()], broken
    stack.r.hset(key, mapping=whole)
    assert client.files.delete(file_id).deleted


def test_a_file_record_that_is_not_whole_is_deleted_with_its_index_entry_and_bytes(stack, gateway, files_dir):
    """A part of a file record is 404 to every read, but its index entry counts toward the tenant's
    file limit: its tenant's delete removes it, index entry and bytes (in Redis or files_dir) included."""
    client = gateway.client()
    for broken in ({"bytes": None}, {"created_at": "soon"}, {"storage": None}, {"storage": "tape"},
                   {"purpose": None, "tenant": None}, {"id": None, "expires_at": "never"}):
        small = upload(client, [chat_line("p", "part")])
        large = client.files.create(file=("l.jsonl", io.BytesIO(b"x" * 70_000 + b"\n")), purpose="batch").id
        for file_id in (small, large):
            key = BATCH_KEYS.file(file_id)
            whole = stack.r.hgetall(key)
            stack.r.delete(key)
            stack.r.hset(key, mapping={k: v for k, v in {**whole, **broken}.items() if v is not None})
            with pytest.raises(openai.NotFoundError, match="No such File object"):
                gateway.client(BOB).files.delete(file_id)  # another tenant's is still 404
            assert client.files.delete(file_id).deleted, broken  # was a 404, the index entry left for good
            assert not stack.r.exists(key, BATCH_KEYS.file_data(file_id)), broken
            assert stack.r.zscore(BATCH_KEYS.files("alice"), file_id) is None, broken
        assert not (files_dir / large).exists(), broken
    indexed_only = upload(client, [chat_line("i", "index entry alone")])
    stack.r.delete(BATCH_KEYS.file(indexed_only))  # a delete cut off between the hash and the index entry
    assert client.files.delete(indexed_only).deleted
    assert stack.r.zscore(BATCH_KEYS.files("alice"), indexed_only) is None
    with pytest.raises(openai.NotFoundError):
        client.files.delete(indexed_only)


def test_a_batch_record_that_is_not_whole_is_404_and_left_out_of_lists_never_a_500(stack, gateway):
    client = gateway.client()
    batch_id = add_batch(stack, "alice", "file-unread", active=False)
    key = BATCH_KEYS.batch(batch_id)
    whole = stack.r.hgetall(key)
    for broken in ({"status": None}, {"status": "lost"}, {"endpoint": None}, {"input_file_id": None},
                   {"completion_window": None}, {"created_at": None}, {"expires_at": "soon"},
                   {"in_progress_at": "inf"}, {"completed": "many"}, {"metadata": "{not json"},
                   {"errors": "[]"}, {"id": None}):
        stack.r.delete(key)
        stack.r.hset(key, mapping={k: v for k, v in {**whole, **broken}.items() if v is not None})
        # was a 500 for a record without status, endpoint and the like (a KeyError), or a time not a number
        for call in (lambda: client.batches.retrieve(batch_id), lambda: client.batches.cancel(batch_id)):
            with pytest.raises(openai.NotFoundError, match="No such Batch object"):
                call()
        assert batch_id not in [b.id for b in client.batches.list(limit=100).data], broken
    stack.r.hset(key, mapping=whole)
    assert client.batches.retrieve(batch_id).status == "validating"
    assert batch_id in [b.id for b in client.batches.list(limit=100).data]


def test_no_fixed_key_lies_under_a_tenant_segment():
    """A key named after a tenant is under a segment no fixed key is under, whatever the tenant's name."""
    fixed = (BATCH_KEYS.active, BATCH_KEYS.expiring_files, KEYS.workers, KEYS.layout, KEYS.dead)
    segments = (BATCH_KEYS.files(""), BATCH_KEYS.batches(""), KEYS.outstanding(""))
    assert [key for key in fixed if key.startswith(segments)] == []  # was the active set, under batches:


def test_a_tenant_named_active_has_its_own_batches_beside_the_active_set(stack, gateway):
    client = gateway.client(ACTIVE)
    file_id = upload(client, [chat_line("t", "mine", model=PARKED)])  # its job waits: the batch stays active
    # was a 500: the tenant's batch index, {prefix}:batches:active, was the active set's key
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: stack.r.hlen(BATCH_KEYS.pending(batch.id)) == 1, timeout=30, what="its line in flight")
    assert batch.id in stack.r.smembers(BATCH_KEYS.active)
    assert [b.id for b in client.batches.list()] == [batch.id]  # the active set is not read as its old index
    assert [f.id for f in client.files.list()] == [file_id]
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert finished(client, batch.id, timeout=30).status == "cancelled"


def test_what_a_gateway_before_the_tenant_segment_indexed_is_listed_and_moved(stack, gateway):
    """An upgraded gateway lists the files and batches an older one indexed under {prefix}:files:{tenant}
    and {prefix}:batches:{tenant}, moving them to the tenant segment; a delete takes the file from either."""
    client = gateway.client(BOB)
    listed, deleted = upload(client, [chat_line("m", "moved")]), upload(client, [chat_line("d", "deleted")])
    batch = client.batches.create(input_file_id=listed, endpoint="/v1/chat/completions", completion_window="24h")
    for new, old, member in ((BATCH_KEYS.files("bob"), BATCH_KEYS.old_files("bob"), listed),
                             (BATCH_KEYS.files("bob"), BATCH_KEYS.old_files("bob"), deleted),
                             (BATCH_KEYS.batches("bob"), BATCH_KEYS.old_batches("bob"), batch.id)):
        stack.r.zadd(old, {member: stack.r.zscore(new, member)})
        stack.r.zrem(new, member)
    assert client.files.delete(deleted).deleted
    assert stack.r.zrange(BATCH_KEYS.old_files("bob"), 0, -1) == [listed]
    assert listed in [f.id for f in client.files.list()] and batch.id in [b.id for b in client.batches.list()]
    assert not stack.r.exists(BATCH_KEYS.old_files("bob"), BATCH_KEYS.old_batches("bob"))
    assert stack.r.zscore(BATCH_KEYS.files("bob"), listed) and stack.r.zscore(BATCH_KEYS.batches("bob"), batch.id)
    assert finished(client, batch.id, timeout=60).status == "completed"


def test_a_batchs_answer_lists_go_at_its_clean_up_though_its_output_file_was_deleted(stack, gateway):
    """A batch answered into Redis lists (validated by a gateway without files_dir) and finalized by one
    with it: its lists, copied to files_dir, are deleted at its clean-up, its output file deleted or not."""
    client = gateway.client()
    batch = client.batches.create(input_file_id=upload(client, [chat_line("o", "out")]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(client, batch.id, timeout=60)
    lines = BATCH_KEYS.output(batch.id)
    # the batch as it is between its end and its clean-up, its answers in Redis
    stack.r.hset(BATCH_KEYS.batch(batch.id), "answers", "lines")
    stack.r.rpush(lines, client.files.content(done.output_file_id).content)
    assert client.files.delete(done.output_file_id).deleted
    stack.r.sadd(BATCH_KEYS.active, batch.id)
    wait_for(lambda: not stack.r.sismember(BATCH_KEYS.active, batch.id), timeout=10, what="the batch cleaned up")
    assert not stack.r.exists(lines)  # was left for good: only a list copied to a file still there was deleted


@pytest.fixture
def plain_gateway(stack):
    """A gateway without files_dir on the stack of ``gateway``, stopped after its test."""
    started = stack.gateway()
    yield started
    started.stop()


def test_a_gateway_without_files_dir_refuses_a_file_kept_there_and_leaves_it_whole(gateway, plain_gateway, files_dir):
    client = gateway.client()
    large = client.files.create(file=("l.jsonl", io.BytesIO(b"x" * 70_000 + b"\n")), purpose="batch")  # over 64 KiB
    plain = plain_gateway.client()
    assert plain.files.retrieve(large.id).bytes == 70_001
    # was: read and deleted ./{id} in its working directory, and dropped the record, the bytes left behind
    for call in (lambda: plain.files.delete(large.id), lambda: plain.files.content(large.id)):
        with pytest.raises(openai.InternalServerError) as caught:
            call()
        assert caught.value.status_code == 503 and caught.value.body["code"] == "files_dir_not_set"
        assert "files_dir, which this gateway has not set (SLUICEWAY_BATCH_FILES_DIR" in caught.value.message
    assert (files_dir / large.id).stat().st_size == 70_001 and plain.files.retrieve(large.id)
    assert client.files.delete(large.id).deleted and not (files_dir / large.id).exists()


@pytest.mark.parametrize("metadata, param, message", [
    ({str(i): "v" for i in range(17)}, "metadata", "metadata: 17 pairs; the limit is 16"),
    ({"ok": "v", "k" * 65: "v"}, "metadata", "metadata: the key 'kkk"),
    ({"ok": "v", "long": "v" * 513}, "metadata.long", "metadata.long: the value is 513 characters; the limit is 512"),
])
def test_metadata_past_openais_limits_is_refused_naming_the_pair_and_the_limit(gateway, metadata, param, message):
    client = gateway.client()
    file_id = upload(client, [chat_line("m", "x")])
    with pytest.raises(openai.BadRequestError) as caught:  # was one message listing every limit, naming no pair
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata=metadata)
    assert caught.value.body["param"] == param and message in caught.value.message
    if param == "metadata" and "key" in message:
        assert "is 65 characters; the limit is 64" in caught.value.message
    at_limits = {str(i): "v" * 512 for i in range(15)} | {"k" * 64: "v"}
    assert client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata=at_limits).metadata == at_limits


DAY = {"anchor": "created_at", "seconds": 24 * 3600}


def expire_now(stack, file_id: str, *, sweep: bool) -> None:
    """Move a file's stored expires_at to the past (and its sweep's schedule with it when ``sweep``)."""
    past = int(time.time()) - 1
    stack.r.hset(BATCH_KEYS.file(file_id), "expires_at", past)
    if sweep:
        stack.r.zadd(BATCH_KEYS.expiring_files, {file_id: past})


def test_a_file_with_expires_after_reports_it_and_is_gone_once_it_passes(stack, gateway, files_dir):
    client = gateway.client()
    small = client.files.create(file=("s.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch", expires_after=DAY)
    large = client.files.create(file=("l.jsonl", io.BytesIO(b"x" * 70_000 + b"\n")), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    kept = upload(client, [chat_line("k", "kept")])
    assert small.expires_at == small.created_at + 24 * 3600 and large.expires_at == large.created_at + 3600
    assert client.files.retrieve(small.id).expires_at == small.expires_at  # was None: the field was ignored
    data_key, path = BATCH_KEYS.file_data(small.id), files_dir / large.id
    assert stack.r.exists(data_key) and path.exists()  # one in Redis, one in the files directory
    for file_id in (small.id, large.id):
        expire_now(stack, file_id, sweep=False)
        # refused from its expires_at on, though no sweep has deleted it yet
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
    listed = [f.id for f in client.files.list()]
    assert small.id not in listed and large.id not in listed and kept in listed
    assert stack.r.exists(data_key) and path.exists()
    for file_id in (small.id, large.id):
        expire_now(stack, file_id, sweep=True)
    wait_for(lambda: not stack.r.exists(BATCH_KEYS.file(small.id), data_key, BATCH_KEYS.file(large.id))
             and not path.exists(), timeout=10, what="the feeder's sweep to delete both files")
    assert stack.r.zscore(BATCH_KEYS.expiring_files, small.id) is None
    assert stack.r.zscore(BATCH_KEYS.files("alice"), large.id) is None and client.files.retrieve(kept)


def test_a_batch_file_without_expires_after_expires_after_30_days_as_openais(stack, gateway):
    client = gateway.client()
    made = client.files.create(file=("d.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    month = 30 * 24 * 3600  # SLUICEWAY_BATCH_DEFAULT_EXPIRES_AFTER's default
    assert made.expires_at == made.created_at + month  # was None: kept until deleted
    assert client.files.retrieve(made.id).expires_at == made.expires_at
    assert stack.r.zscore(BATCH_KEYS.expiring_files, made.id) == made.expires_at  # the sweep's schedule
    batch = client.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(client, batch.id, timeout=60)  # its output and error files keep no default, as OpenAI's
    assert done.error_file_id and client.files.retrieve(done.error_file_id).expires_at is None


def test_an_expired_input_keeps_its_bytes_until_its_running_batch_ends(stack, gateway):
    client = gateway.client()
    data = b"".join(json.dumps(chat_line(f"i-{i}", "wait", model=PARKED)).encode() + b"\n" for i in range(2))
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch", expires_after=DAY).id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: stack.r.hlen(BATCH_KEYS.pending(batch.id)) == 2, timeout=30, what="two lines in flight")
    expire_now(stack, file_id, sweep=True)
    # the sweep looks again later rather than deleting what the batch reads
    wait_for(lambda: (stack.r.zscore(BATCH_KEYS.expiring_files, file_id) or 0) > time.time(), timeout=10,
             what="the sweep to put the file off")
    assert stack.r.exists(BATCH_KEYS.file_data(file_id))
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    client.batches.cancel(batch.id)
    assert finished(client, batch.id, timeout=30).status == "cancelled"
    expire_now(stack, file_id, sweep=True)
    wait_for(lambda: not stack.r.exists(BATCH_KEYS.file(file_id), BATCH_KEYS.file_data(file_id)), timeout=10,
             what="the sweep to delete the file")


def test_output_expires_after_gives_the_batch_files_that_expiry(stack, gateway, files_dir):
    client = gateway.client()
    batch = client.batches.create(input_file_id=upload(client, [chat_line("x-0", "fine"), "not json"]),
                                  endpoint="/v1/chat/completions", completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})  # was a 400
    done = finished(client, batch.id, timeout=60)
    assert done.status == "completed"
    for file_id in (done.output_file_id, done.error_file_id):
        made = client.files.retrieve(file_id)
        assert made.expires_at == made.created_at + 7200
        expire_now(stack, file_id, sweep=True)
    wait_for(lambda: not any((files_dir / f).exists() or stack.r.exists(BATCH_KEYS.file(f))
                             for f in (done.output_file_id, done.error_file_id)), timeout=10,
             what="the sweep to delete the output and error files")
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)


@pytest.mark.parametrize("expiry, param, message", [
    ({"anchor": "created_at", "seconds": 10}, "seconds", "seconds: must be between 3600 and 2592000, got 10"),
    ({"anchor": "created_at", "seconds": 2592001}, "seconds", "seconds: must be between 3600 and 2592000, got 2592001"),
    ({"anchor": "created_at", "seconds": "soon"}, "seconds", "seconds: must be an integer, got 'soon'"),
    ({"anchor": "last_active_at", "seconds": 3600}, "anchor", "anchor: must be 'created_at', got 'last_active_at'"),
])
def test_an_expiry_past_openais_limits_is_refused_naming_the_field_and_the_limit(gateway, expiry, param, message):
    client = gateway.client()
    file_id = upload(client, [chat_line("m", "x")])
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after=expiry)
    assert caught.value.body["param"] == f"output_expires_after.{param}"
    assert f"output_expires_after.{message}" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("e.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=expiry)
    assert caught.value.body["param"] == f"expires_after.{param}" and f"expires_after.{message}" in caught.value.message


def test_answer_lines_have_batch_req_ids_and_their_job_as_request_id(gateway):
    client = gateway.client()
    batch = client.batches.create(input_file_id=upload(client, [chat_line("r-0", "fine"), "not json"]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(client, batch.id, timeout=60)
    [out], [err] = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    # was the job id, f"{batch.id}-1"; OpenAI's (and sluiceway bulk --format openai's) start batch_req_
    assert re.fullmatch(r"batch_req_[0-9a-f]{24}", out["id"]) and re.fullmatch(r"batch_req_[0-9a-f]{24}", err["id"])
    assert out["response"]["request_id"] == f"{batch.id}-1" and out["id"] != err["id"]
    again = client.batches.create(input_file_id=upload(client, [chat_line("r-0", "fine")]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert lines_of(client, finished(client, again.id, timeout=60).output_file_id)[0]["id"] != out["id"]


def test_a_cancel_after_the_window_passed_is_refused_and_the_batch_ends_expired(stack, gateway):
    client = gateway.client()
    batch = client.batches.create(input_file_id=upload(client, [chat_line(f"w-{i}", "wait", model=PARKED)
                                                                for i in range(2)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    key, lease = BATCH_KEYS.batch(batch.id), BATCH_KEYS.lease(batch.id)
    wait_for(lambda: stack.r.hlen(BATCH_KEYS.pending(batch.id)) == 2, timeout=30, what="two lines in flight")
    stack.r.set(lease, "test:0:hold", px=60_000)  # its feeder stops at its next pass: the batch stays as set here
    stack.r.hset(key, "expires_at", time.time() - 1)  # past its window, not flagged yet
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch that has expired"):
        client.batches.cancel(batch.id)  # was: cancelling, and the batch ended cancelled
    stack.r.hset(key, "stop", "expire")  # as the feeder flags it (batch_feeder.Feeder._run)
    with pytest.raises(openai.ConflictError, match="status 'in_progress'") as caught:
        client.batches.cancel(batch.id)
    assert caught.value.body["code"] == "batch_not_cancellable"
    stack.r.delete(lease)
    done = finished(client, batch.id, timeout=30)
    assert done.status == "expired" and done.cancelling_at is None and done.request_counts.failed == 2
    assert {r["error"]["code"] for r in lines_of(client, done.error_file_id)} == {"batch_expired"}


def completion_line(custom_id: str, prompt, model: str = MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, **body}}


def test_completions_lines_of_several_prompts_answer_what_the_endpoint_answers(gateway):
    """A line whose body holds several prompts is a job each and one answer: the body the endpoint
    answers for it (greedy: the same choices in index order, the usage summed). A prompt that fails
    makes its line an error line naming it, with the endpoint's status and code; the others run."""
    client = gateway.client()
    rows = [completion_line("one", "The quick brown fox"),
            completion_line("three", ["Hello", "Queues hold", "A"], n=2, logprobs=1),
            completion_line("tokens", [[5, 6, 7], [8, 9]], echo=True, logprobs=0),
            completion_line("fails", [[5] * 8, [5] * 600, [6] * 8], max_tokens=400),
            completion_line("last", "x")]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                  completion_window="24h")
    done = finished(client, batch.id, timeout=60)  # was: every line of several prompts an error line
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (4, 1)
    out = {r["custom_id"]: r["response"] for r in lines_of(client, done.output_file_id)}
    assert sorted(out) == ["last", "one", "three", "tokens"]
    assert out["three"]["request_id"] == f"{batch.id}-2"
    for row in rows:
        if row["custom_id"] in out:
            sync = json.loads(client.completions.with_raw_response.create(**row["body"]).text)
            line = out[row["custom_id"]]["body"]
            assert alike({k: v for k, v in line.items() if k not in ("id", "created")},
                         {k: v for k, v in sync.items() if k not in ("id", "created")}), (line, sync)
    assert [c["index"] for c in out["three"]["body"]["choices"]] == list(range(6))
    [error] = lines_of(client, done.error_file_id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**rows[3]["body"])
    assert error["custom_id"] == "fails" and error["response"]["status_code"] == caught.value.status_code == 400
    assert error["response"]["body"]["error"]["code"] == caught.value.body["code"] == "context_length_exceeded"
    assert error["response"]["body"]["error"]["message"].startswith("prompt.1: ")
    assert error["response"]["request_id"] == f"{batch.id}-4"


def test_a_line_of_several_prompts_fed_again_submits_none_twice_and_a_cancel_ends_them_all(stack, gateway):
    """Each prompt's job id is the line's and its index, so a line read again (as a holder killed
    before it stored its cursor leaves it to the next) submits nothing new; a cancel ends every job."""
    client = gateway.client()
    rows = [completion_line(f"s-{i}", [f"wait {i}.{j}" for j in range(i + 1)], model=PARKED) for i in range(4)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                  completion_window="24h")
    key, pending = BATCH_KEYS.batch(batch.id), BATCH_KEYS.pending(batch.id)
    wait_for(lambda: stack.r.hlen(pending) == 10, timeout=30, what="ten prompts in flight")  # each prompt counts
    expected = sorted(f"{batch.id}-{line}" + (f"-{j}" if j else "") for line in range(1, 5) for j in range(line))

    def queued() -> list[str]:
        return sorted(job["id"] for _, f in stack.r.xrange(KEYS.queue(PARKED)) if (job := json.loads(f["job"]))[
            "id"].startswith(batch.id + "-"))

    assert queued() == expected and sorted(stack.r.hkeys(pending)) == expected
    stack.r.hset(key, mapping={"cursor_offset": 0, "cursor_line": 0})
    wait_for(lambda: stack.r.hget(key, "cursor_line") == "4", timeout=30, what="the lines read again")
    assert queued() == expected and stack.r.hlen(pending) == 10  # ids made anew would have queued ten more
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id, timeout=30)
    assert done.status == "cancelled" and done.request_counts.completed == done.request_counts.failed == 0
    assert queued() == [] and not stack.r.exists(pending)
