"""The bulk pipeline: order, backpressure, resume, retries, bad lines; real Redis, hand worker."""

import json
import subprocess
import sys
import time

import pytest

from producers.bulk import Bulk, BulkError, json_line
from producers.bulk_input import attempt_id, derived_id
from producers.protocol import Keys, Status, parse_job
from tests.producers.peer import HandWorker

K = Keys("sluiceway")


def write_in(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_out(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def queued_ids(client, queue="bulk"):
    return [parse_job(f["job"]).id for _, f in client.redis.xrange(K.queue(queue))]


def run(client, tmp_path, **options):
    options.setdefault("progress", False)
    messages = []
    summary = Bulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", report=messages.append, **options).run()
    return summary, messages


def test_ids_are_derived_from_key_line_and_content():
    key, other = b"k" * 32, b"o" * 32
    assert derived_id(key, 3, b'{"prompt": "a"}') == derived_id(key, 3, b'{"prompt": "a"}')
    assert derived_id(key, 3, b'{"prompt": "a"}') != derived_id(key, 4, b'{"prompt": "a"}')
    assert derived_id(key, 3, b'{"prompt": "a"}') != derived_id(other, 3, b'{"prompt": "a"}')
    assert attempt_id("row-1", 0) == "row-1" and attempt_id("row-1", 2) == "row-1.r2"
    assert len(attempt_id("x" * 128, 1)) <= 128


def test_rows_come_out_in_input_order_with_their_metadata(client, redis_server, tmp_path):
    rows = [{"prompt": f"q{i}", "metadata": {"row": i}} for i in range(40)]
    rows[7] = {"prompt": "q7", "sampling": {"temperature": -1}, "metadata": {"row": 7}}
    rows[9] = "{not json"
    rows[12] = {"prompt": "q12", "metadata": {"row": 12, "fail": True}}
    rows.insert(20, "")  # blank lines are not rows
    write_in(tmp_path / "in.jsonl", rows)
    with HandWorker(redis_server) as worker:
        summary, messages = run(client, tmp_path, max_outstanding=5)
    out = read_out(tmp_path / "out.jsonl")
    assert [r["line"] for r in out] == [n for n in range(1, 42) if n != 21]
    assert out[0]["status"] == "done" and out[0]["text"] == "Q0" and out[0]["metadata"] == {"row": 0}
    assert out[0]["result"]["usage"]["completion_tokens"] == 3
    assert out[7]["status"] == "invalid" and "line 8: sampling.temperature: temperature must be >= 0" in out[7]["error"]
    assert out[9]["status"] == "invalid" and out[9]["error"].startswith("line 10: not valid JSON")
    assert out[12]["status"] == "failed" and "CUDA out of memory" in out[12]["error"]
    assert [r["text"] for r in out[30:32]] == ["Q30", "Q31"]
    assert (summary.done, summary.failed, summary.invalid, summary.rows) == (37, 1, 2, 40)
    assert summary.completion_tokens == 37 * 3 and summary.complete
    assert any("line 8" in m for m in messages) and any("line 13" in m for m in messages)
    assert worker.max_outstanding <= 5  # backpressure


def test_resume_neither_resubmits_nor_reruns(client, peer, tmp_path):
    write_in(tmp_path / "in.jsonl", [{"prompt": f"q{i}", "metadata": {"row": i}} for i in range(6)])
    summary, _ = run(client, tmp_path, timeout=0.3)  # no worker: nothing ends
    assert not summary.complete and summary.still_running == 6
    ids = queued_ids(client)
    assert len(ids) == 6 and read_out(tmp_path / "out.jsonl") == []

    for job_id in ids[:3]:
        peer.finish(job_id)
    summary, _ = run(client, tmp_path, timeout=0.3)
    assert queued_ids(client) == ids  # nothing submitted again
    assert [r["id"] for r in read_out(tmp_path / "out.jsonl")] == ids[:3]
    assert summary.done == 3 and not summary.complete

    with open(tmp_path / "out.jsonl", "a") as f:
        f.write('{"line": 4, "id": "half a li')  # a kill in the middle of a write
    for job_id in ids[3:]:
        peer.finish(job_id)
    peer.redis.hset(K.job(ids[0]), "status", "queued")  # would be noticed if row 1 were read again
    summary, _ = run(client, tmp_path)
    out = read_out(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == ids and [r["metadata"]["row"] for r in out] == list(range(6))
    assert summary.complete and summary.kept == 3 and summary.done == 3
    assert queued_ids(client) == ids


def test_retry_failed_resubmits_with_a_fresh_id(client, peer, tmp_path):
    write_in(tmp_path / "in.jsonl", [{"prompt": "a", "id": "row-a"}, {"prompt": "b", "id": "row-b"}, "[]"])
    peer.finish("row-a")
    client.submit("b", job_id="row-b", queue="bulk")
    peer.finish("row-b", Status.EXPIRED, error="deadline passed while queued")
    summary, messages = run(client, tmp_path)
    out = read_out(tmp_path / "out.jsonl")
    assert [r["status"] for r in out] == ["done", "expired", "invalid"]
    assert out[1]["error"] == "deadline passed while queued" and summary.failed == 1
    first_row = (tmp_path / "out.jsonl").read_text().splitlines()[0]

    summary, _ = run(client, tmp_path, retry_failed=True, timeout=0.3)
    assert not summary.complete and queued_ids(client)[-1] == "row-b.r1"
    assert read_out(tmp_path / "out.jsonl")[1]["status"] == "expired"  # OUT untouched until the end

    peer.finish("row-b.r1")
    summary, _ = run(client, tmp_path, retry_failed=True)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert lines[0] == first_row
    retried = json.loads(lines[1])
    assert retried["id"] == "row-b.r1" and retried["status"] == "done" and retried["attempt"] == 1
    assert summary.complete and summary.retried == 1 and summary.kept == 2
    assert not (tmp_path / "out.jsonl.tmp").exists()
    assert queued_ids(client).count("row-b.r1") == 1


def test_out_of_another_input_is_refused(client, peer, tmp_path):
    write_in(tmp_path / "in.jsonl", [{"prompt": "a", "id": "x"}])
    peer.finish("x")
    run(client, tmp_path)
    write_in(tmp_path / "in.jsonl", [{"prompt": "a", "id": "y"}])
    with pytest.raises(BulkError, match="another input"):
        run(client, tmp_path)


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_killed_cli_run_resumes(client, peer, redis_server, tmp_path):
    write_in(tmp_path / "in.jsonl", [{"prompt": f"q{i}", "metadata": {"row": i}} for i in range(30)])
    out_path = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "producers.cli", "bulk", str(tmp_path / "in.jsonl"), str(out_path),
               "--redis", redis_server, "--no-progress"]
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: client.redis.xlen(K.queue("bulk")) == 30, what="30 submissions")
    ids = queued_ids(client)
    for job_id in ids[:10]:
        peer.finish(job_id)
    wait_for(lambda: out_path.exists() and len(out_path.read_text().splitlines()) == 10, what="10 rows written")
    run.kill()  # SIGKILL: no chance to clean up
    run.communicate()

    for job_id in ids[10:]:
        peer.finish(job_id)
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "30 rows: 20 done, 0 failed, 0 invalid, 10 already in OUT" in again.stderr
    assert [r["id"] for r in read_out(out_path)] == ids
    assert queued_ids(client) == ids  # nothing was submitted twice


def test_out_lines_escape_what_splitlines_would_cut():
    """Generated text may hold U+2028, U+2029 or NEL, which JSON leaves raw; OUT escapes them so
    that a reader splitting with str.splitlines() still sees one row per line."""
    text = "a\u2028b\u2029c\x85d, é and 漢字 stay as they are"
    line = json_line({"text": text})
    assert line.endswith("\n") and len(line.splitlines()) == 1
    assert json.loads(line)["text"] == text
    assert "é" in line and "漢字" in line


def test_an_out_that_is_not_a_bulk_output_is_refused_untouched(client, tmp_path):
    """OUT named as the input itself (or a link to it), or as someone's JSONL whose last line has
    no line end: the run refuses it before cutting that line off as a half-written row, submits
    nothing and leaves no run key beside it."""
    in_path = tmp_path / "in.jsonl"
    source = b'{"prompt": "a"}\n{"prompt": "b"}'
    link, gold = tmp_path / "link.jsonl", tmp_path / "gold.jsonl"
    link.symlink_to(in_path)
    cases = [(in_path, source, "is the input file"), (link, source, "is the input file"),
             (gold, b'{"answer": 1}\n{"answer": 2}', "gold.jsonl:1 is not a row of a bulk output"),
             (gold, b'{"answer": 1}', "gold.jsonl:1 is not a bulk output row cut short")]
    for out, contents, match in cases:
        out.write_bytes(contents)
        with pytest.raises(BulkError, match=match):
            Bulk(client, in_path, out, progress=False).run()
        assert out.read_bytes() == contents
        assert not out.with_name(out.name + ".key").exists()
    assert client.redis.exists(K.queue("bulk")) == 0
