"""``sluiceway bulk --format openai``: OpenAI batch files over the queue, bad lines, resume."""

import json
import subprocess
import sys
from pathlib import Path

from producers.bulk_openai import OpenAIBulk
from producers.protocol import Keys
from tests.producers.peer import HandWorker

K = Keys("sluiceway")


def chat(custom_id, text, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, **body}}


def completion(custom_id, text, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": text, "max_tokens": 2, **body}}


def mixed_rows():
    """30 lines: 24 good, one malformed, one duplicate custom_id, one unknown url, one body the
    gateway rejects, one with an unknown field, one whose job fails."""
    rows = [chat(f"c{i}", f"chat {i}") if i % 2 else completion(f"c{i}", f"text {i}") for i in range(30)]
    rows[3] = '{"custom_id": "c3", "method": "POST", '  # not JSON
    rows[5] = chat("c4", "again")  # c4 is line 5's custom_id already
    rows[8] = {**completion("c8", "x"), "url": "/v1/embeddings"}
    rows[11] = chat("c11", "x", temperature=-1)
    rows[14] = completion("c14", "x", suffix="no")
    rows[17] = completion("fail17", "fail: the hand worker fails this one")
    return rows


def write_in(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def lines_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_mixed(out, err):
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(30) if i not in (3, 5, 8, 11, 14, 17))
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    by_line = {r["error"]["line"]: r for r in err if r["error"]}
    assert sorted(by_line) == [4, 6, 9, 12, 15]
    assert "not valid JSON" in by_line[4]["error"]["message"] and by_line[4]["custom_id"] is None
    assert by_line[6]["error"]["code"] == "duplicate_custom_id" and "line 5" in by_line[6]["error"]["message"]
    assert "url '/v1/embeddings' is not supported" in by_line[9]["error"]["message"]
    assert "line 12: body.sampling.temperature" in by_line[12]["error"]["message"]
    assert "line 15: body.suffix: insertion is not supported" in by_line[15]["error"]["message"]
    failed = [r for r in err if r["response"]]
    assert [r["custom_id"] for r in failed] == ["fail17"] and failed[0]["response"]["status_code"] == 500
    assert "CUDA out of memory" in failed[0]["response"]["body"]["error"]["message"]
    ids = [r["id"] for r in out + err]
    assert len(set(ids)) == len(ids) == 30


def test_openai_file_answers_every_line_once_with_bad_lines_in_the_error_file(client, redis_server, tmp_path):
    write_in(tmp_path / "in.jsonl", mixed_rows())
    with HandWorker(redis_server) as worker:
        summary = OpenAIBulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl",
                             max_outstanding=4).run()
    assert worker.max_outstanding <= 4
    assert (summary.rows, summary.done, summary.failed, summary.invalid) == (30, 24, 1, 5) and summary.complete
    out, err = lines_of(tmp_path / "out.jsonl"), lines_of(tmp_path / "err.jsonl")
    check_mixed(out, err)
    first = next(r for r in out if r["custom_id"] == "c1")
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "CHAT 1"}
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    second = next(r for r in out if r["custom_id"] == "c2")["response"]["body"]
    assert second["object"] == "text_completion" and second["choices"][0]["text"] == "TEXT 2"


def several_prompt_rows():
    """``mixed_rows`` with two completions lines of several prompts: c2 (three prompts) and fail20
    (two, the second of which the hand worker fails)."""
    rows = mixed_rows()
    rows[2] = completion("c2", ["text 2", "more 2", "last 2"])
    rows[20] = completion("fail20", ["text 20", "fail: 20"])
    return rows


def test_a_rerun_resumes_without_submitting_or_writing_anything_twice(client, redis_server, tmp_path):
    write_in(tmp_path / "in.jsonl", several_prompt_rows())  # 25 lines to run, 28 jobs
    paths = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    # No worker: the run stops at its timeout with the bad lines answered and the rest in flight.
    first = OpenAIBulk(client, *paths, max_outstanding=25, timeout=0.3).run()
    # each prompt a job in flight: 25 jobs are the first 22 lines
    assert not first.complete and first.invalid == 5 and first.still_running == 22
    assert len(lines_of(paths[2])) == 5 and not paths[1].exists() or not lines_of(paths[1])
    with open(paths[2], "a") as f:
        f.write('{"id": "batch_req_cut sho')  # a line a kill cut short
    with HandWorker(redis_server) as worker:
        second = OpenAIBulk(client, *paths, max_outstanding=10).run()
    assert second.complete and second.kept == 5 and second.invalid == 0 and second.done == 23
    assert worker.seen == 28  # the 25 jobs of the first run were not enqueued again
    out, err = lines_of(paths[1]), lines_of(paths[2])
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(30)
                                                         if i not in (3, 5, 8, 11, 14, 17, 20))
    several = next(r for r in out if r["custom_id"] == "c2")["response"]["body"]
    assert [(c["index"], c["text"]) for c in several["choices"]] == [(0, "TEXT 2"), (1, "MORE 2"), (2, "LAST 2")]
    assert several["usage"] == {"prompt_tokens": 27, "completion_tokens": 9, "total_tokens": 36}
    failed = sorted((r for r in err if r["response"]), key=lambda r: r["custom_id"])
    assert [r["custom_id"] for r in failed] == ["fail17", "fail20"]
    assert failed[1]["response"]["body"]["error"]["message"] == "prompt.1: model error: CUDA out of memory"
    assert len(err) == 7 and len({r["id"] for r in out + err}) == 30
    third = OpenAIBulk(client, *paths).run()
    assert third.kept == 30 and third.done == third.failed == third.invalid == 0
    # IN edited after the run (a custom_id, a body, a bad line): refused, OUT untouched (was: the
    # edited lines counted as answered, their old answers kept)
    import pytest

    from producers.bulk_output import BulkError

    answers = paths[1].read_bytes(), paths[2].read_bytes()
    for line, row in ((2, chat("other", "chat 1")), (2, chat("c1", "chat 1 edited")), (4, chat("c3", "now good"))):
        rows = several_prompt_rows()
        rows[line - 1] = row
        write_in(paths[0], rows)
        with pytest.raises(BulkError, match=f"in.jsonl line {line} is not the line .*out.jsonl answered"):
            OpenAIBulk(client, *paths).run()
        assert (paths[1].read_bytes(), paths[2].read_bytes()) == answers


def test_the_command_writes_errors_into_out_by_default_as_vllm_run_batch_does(redis_server, tmp_path):
    write_in(tmp_path / "in.jsonl", mixed_rows())
    with HandWorker(redis_server):
        proc = subprocess.run(
            [sys.executable, "-m", "sluiceway", "bulk", "--format", "openai", str(tmp_path / "in.jsonl"),
             str(tmp_path / "out.jsonl"), "--redis", redis_server, "--no-progress"],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # some rows failed
    assert "30 rows: 24 done, 1 failed, 5 invalid" in proc.stderr
    rows = lines_of(tmp_path / "out.jsonl")
    check_mixed([r for r in rows if r["response"] and r["response"]["status_code"] == 200],
                [r for r in rows if not r["response"] or r["response"]["status_code"] != 200])


def test_an_out_or_err_that_is_not_a_batch_output_is_refused_untouched(client, tmp_path):
    """ERR named as the input, or OUT as a file of one line without its line end that is not a
    batch output line: refused before the run cuts that line off, nothing submitted."""
    import pytest

    from producers.bulk_output import BulkError

    in_path = write_in(tmp_path / "in.jsonl", [chat("c0", "hi")])
    gold = tmp_path / "gold.jsonl"
    gold.write_bytes(b'{"custom_id": "c0", "expected": "A"}')
    with pytest.raises(BulkError, match="gold.jsonl:1 is not an OpenAI batch output line cut short"):
        OpenAIBulk(client, in_path, gold, timeout=2).run()  # (no worker: a run that went on would stop here)
    assert gold.read_bytes() == b'{"custom_id": "c0", "expected": "A"}'
    with pytest.raises(BulkError, match="ERR .* is the input file"):
        OpenAIBulk(client, in_path, tmp_path / "out.jsonl", in_path).run()
    assert client.redis.exists(K.queue("bulk")) == 0


def test_an_out_or_err_it_cannot_write_is_one_error_naming_the_file(client, tmp_path):
    """ERR (or OUT) where no file can be made (a read-only place; /proc refuses new files even
    to root): a ``BulkError`` naming the path (was the OSError's traceback), nothing submitted."""
    import pytest

    from producers.bulk import Bulk
    from producers.bulk_output import BulkError

    in_path = write_in(tmp_path / "in.jsonl", [chat("c0", "hi")])
    with pytest.raises(BulkError, match=r"cannot write /proc/1/err\.jsonl: "):
        OpenAIBulk(client, in_path, tmp_path / "out.jsonl", Path("/proc/1/err.jsonl")).run()
    with pytest.raises(BulkError, match=r"cannot write the run key /proc/1/out\.jsonl\.key: "):
        Bulk(client, in_path, Path("/proc/1/out.jsonl")).run()
    assert client.redis.exists(K.queue("bulk")) == 0
