"""Bulk row ids come from a secret run key kept beside OUT: stable on resume, unguessable to others."""

import hashlib
import json
import stat

import pytest

from producers.bulk import Bulk, BulkError
from producers.protocol import Keys
from tests.producers.peer import HandWorker, result_for
from tests.producers.test_bulk import queued_ids, read_out, write_in

K = Keys("sluiceway")


def run(client, tmp_path, out="out.jsonl", **options):
    options.setdefault("progress", False)
    messages = []
    summary = Bulk(client, tmp_path / "in.jsonl", tmp_path / out, report=messages.append, **options).run()
    return summary, messages


def test_two_fresh_runs_get_different_ids_and_a_resumed_run_the_same(client, peer, tmp_path):
    write_in(tmp_path / "in.jsonl", [{"prompt": f"q{i}"} for i in range(3)] + [{"prompt": "q3", "id": "mine"}])
    run(client, tmp_path, "a.jsonl", timeout=0.3)  # no worker: nothing ends
    first = queued_ids(client)
    assert first[3] == "mine" and all(job_id.startswith("bulk-") for job_id in first[:3])

    run(client, tmp_path, "b.jsonl", timeout=0.3)  # the same file, a fresh OUT: a fresh key
    second = queued_ids(client)[4:]
    assert len(second) == 3 and not set(second) & set(first)  # "mine" is known already: not queued again
    key = tmp_path / "a.jsonl.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) == 64
    assert (tmp_path / "b.jsonl.key").read_text() != key.read_text()

    peer.finish(first[0])
    summary, _ = run(client, tmp_path, "a.jsonl", timeout=0.3)
    assert queued_ids(client)[:4] == first and len(queued_ids(client)) == 7  # nothing submitted again
    assert [r["id"] for r in read_out(tmp_path / "a.jsonl")] == first[:1] and summary.done == 1

    for job_id in first[1:]:
        peer.finish(job_id)
    peer.redis.hset(K.job(first[0]), "status", "queued")  # would show if row 1 were read again
    summary, _ = run(client, tmp_path, "a.jsonl")
    assert [r["id"] for r in read_out(tmp_path / "a.jsonl")] == first
    assert summary.complete and summary.kept == 1 and summary.done == 3
    assert len(queued_ids(client)) == 7


def test_a_squatter_on_the_old_derived_id_does_not_get_into_out(client, redis_server, peer, tmp_path):
    """Ids used to be a plain hash of the line number and text: anyone who could guess a row
    could submit its job first, and the victim's OUT then held the squatter's output."""
    text = json.dumps({"prompt": "victim", "metadata": {"row": 1}})
    write_in(tmp_path / "in.jsonl", [text])
    squatted = "bulk-" + hashlib.sha256(f"1\n{text}".encode()).hexdigest()[:32]
    client.submit("squatter", job_id=squatted, queue="bulk")
    peer.finish(squatted, result=result_for(squatted, "SQUATTED"))
    with HandWorker(redis_server):
        summary, _ = run(client, tmp_path)
    (row,) = read_out(tmp_path / "out.jsonl")
    assert row["status"] == "done" and row["text"] == "VICTIM" and row["id"] != squatted
    assert summary.done == 1 and summary.complete


def test_a_lost_run_key_keeps_out_and_restarts_the_other_rows_under_new_ids(client, redis_server, peer, tmp_path):
    write_in(tmp_path / "in.jsonl", [{"prompt": f"q{i}"} for i in range(4)] + ["[]"])
    run(client, tmp_path, timeout=0.3)
    ids = queued_ids(client)
    for job_id in ids[:2]:
        peer.finish(job_id)
    run(client, tmp_path, timeout=0.3)
    kept = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in kept] == ids[:2]

    (tmp_path / "out.jsonl.key").unlink()
    with HandWorker(redis_server):
        summary, messages = run(client, tmp_path)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert lines[:2] == kept
    out = [json.loads(line) for line in lines]
    assert [r["status"] for r in out] == ["done"] * 4 + ["invalid"]
    assert not {out[2]["id"], out[3]["id"]} & set(ids)  # restarted under new ids
    assert summary.complete and summary.kept == 2 and summary.done == 2
    assert any("run key" in m and "missing" in m for m in messages)

    (tmp_path / "out.jsonl.key").write_text("not a key\n")
    with pytest.raises(BulkError, match="run key .* is damaged"):
        run(client, tmp_path)


def test_a_repeated_id_is_an_invalid_row_and_every_other_row_is_written(client, redis_server, tmp_path):
    """Two rows in flight under one id used to leave the first waiting forever: the run ended
    'complete' with nothing written after it (here: OUT empty, exit 0)."""
    write_in(tmp_path / "in.jsonl", [{"prompt": "a", "id": "d1"}, {"prompt": "b", "id": "d1"}, {"prompt": "c"}])
    with HandWorker(redis_server):
        summary, messages = run(client, tmp_path, timeout=20)
    out = read_out(tmp_path / "out.jsonl")
    assert [(r["line"], r["status"], r["text"]) for r in out] == [(1, "done", "A"), (2, "invalid", None),
                                                                  (3, "done", "C")]
    assert out[1]["error"] == "line 2: id 'd1' is already the id of line 1; ids must be unique within a file"
    assert summary.complete and summary.invalid == 1
