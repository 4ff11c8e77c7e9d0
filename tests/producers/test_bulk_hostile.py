"""``sluiceway bulk`` on hostile files: every bad line an ``invalid`` row, the rest run, memory bounded.

The real CLI as a subprocess, a real redis-server, and a real worker on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

LIMIT = 128 * 1024  # the line-size limit these runs are given (the default is 8 MiB)
GREEDY = {"temperature": 0, "max_tokens": 2}


def good(row: int, **fields) -> bytes:
    return json.dumps({"prompt": f"row {row}", "sampling": GREEDY, "metadata": {"row": row}, **fields}).encode()


# (line bytes, what its OUT row must say: None for a done row, else pieces of its error, one of which it holds)
HOSTILE: list[tuple[bytes, str | tuple[str, ...] | None]] = [
    (b"\xef\xbb\xbf" + good(1), None),  # a UTF-8 byte-order mark before the first line
    (b"[" * 100_000, "JSON nested 100,000 levels deep; the limit is 64"),
    (good(3) + b"\r", None),  # a CRLF line end
    (b'{"prompt": "one \xff byte"}', "not valid UTF-8: byte 0xff at byte 17"),
    (json.dumps({"prompt": "x" * (LIMIT + 100)}).encode(), f"the limit is {LIMIT:,} bytes"),
    (b'{"prompt": "a raw\rCR in a string"}', "not valid JSON: Invalid control character"),
    (b'{"prompt": "row 7",\r"sampling": {"max_tokens": 2}, "metadata": {"row": 7}}', None),  # CR between tokens
    (b'{"prompt": "n", "metadata": {"n": ' + b"9" * 5000 + b"}}", "a number has 5,000 digits"),
    (b'{"prompt": "n", "metadata": {"x": NaN}}', "NaN is not a JSON number"),
    (b'{"prompt": "n", "deadline": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "n", "deadline": 1e999}', "the number 1e999 is too large"),
    (b"[1, 2]", "a job must be a JSON object, got list"),
    (b'"just a string"', "a job must be a JSON object, got str"),
    (b'{"prompt": "n", "id": 5}', "id: expected a string, got the integer 5"),
    (b'{"prompt": "lone \\ud800 surrogate"}', "lone surrogate \\ud800"),
    (good(16, prompt="[" * 100 + "{" * 100), None),  # brackets in a string are not nesting
    (b'{"prompt": "n", "metadata": {"deep": ' + b"[" * 500 + b"]" * 500 + b"}}", "nested 502 levels"),
    (b'{"prompt": "n", "sampling": {"stop": 5}}', "sampling.stop: expected a string or an array of strings, got the integer 5"),
    (good(19, id="dup-1"), None),
    (good(20, id="dup-1"), "id 'dup-1' is already the id of line 19"),
    (b"   \t", None),  # blank: not a row
    (b"\r", None),  # blank too, with a CRLF end
    (good(23)[:-1], "not valid JSON"),  # cut short
    (good(24), None),
]


def hostile_file(path):
    body = b"\n".join(line for line, _ in HOSTILE)  # the last line has no line end
    path.write_bytes(body)
    return path


def expected_rows():
    for number, (line, error) in enumerate(HOSTILE, start=1):
        if line.strip():
            yield number, error


def bulk_command(in_path, out_path, redis_url):
    return [sys.executable, "-m", "producers.cli", "bulk", str(in_path), str(out_path), "--redis", redis_url,
            "--no-progress"]


def bulk_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    return {**env, "SLUICEWAY_BULK_MAX_LINE_BYTES": str(LIMIT), **extra}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("torch")
    from engine import EngineArgs, LLMEngine
    from engine.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")
    engine = LLMEngine(EngineArgs(model=str(model), device="cpu", max_num_seqs=8, swap_space=0.01, seed=0))
    yield model, engine
    engine.shutdown()


@pytest.fixture
def worker(engine, redis_server):
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    model, llm = engine
    settings = WorkerSettings(model=str(model), redis=redis_server, name="hostile", device="cpu",
                              cancel_poll_seconds=0.05, swap_space="0.01", grace_period=5.0, celery=False)
    running = Worker(settings, engine=llm)
    thread = threading.Thread(target=running.work, daemon=True)
    thread.start()
    yield running
    running.request_stop(immediately=True)
    thread.join(30)
    assert not thread.is_alive(), "the worker did not stop"


def test_every_bad_line_becomes_an_invalid_row_and_the_rest_run(worker, redis_server, tmp_path):
    in_path, out_path = hostile_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    run = subprocess.run(bulk_command(in_path, out_path, redis_server), env=bulk_env(), capture_output=True,
                         text=True, timeout=120)
    expected = list(expected_rows())
    bad = sum(error is not None for _, error in expected)
    assert f"{len(expected)} rows: {len(expected) - bad} done, 0 failed, {bad} invalid" in run.stderr, run.stderr
    assert run.returncode == 1  # some rows invalid
    out = [json.loads(line) for line in out_path.read_bytes().split(b"\n")[:-1]]
    assert [r["line"] for r in out] == [number for number, _ in expected]  # one row per line, in order
    for row, (number, error) in zip(out, expected):
        if error is None:
            assert row["status"] == "done" and row["text"] is not None, row
            assert row["result"]["usage"]["completion_tokens"] == 2
        else:
            assert row["status"] == "invalid" and row["id"] is None, row
            pieces = (error,) if isinstance(error, str) else error
            assert row["error"].startswith(f"line {number}: "), row["error"]
            assert any(piece in row["error"] for piece in pieces), row["error"]
    assert [r["metadata"].get("row") for r in out if r["status"] == "done"] == [1, 3, 7, 16, 19, 24]

    again = subprocess.run(bulk_command(in_path, out_path, redis_server), env=bulk_env(), capture_output=True,
                           text=True, timeout=60)
    assert f"{len(expected)} already in OUT" in again.stderr, again.stderr  # a re-run reads it the same way


# The CLI, printing its own peak resident memory (VmHWM: this process's, not its parent's) at exit.
PEAK_CLI = ("import atexit, sys\n"
            "atexit.register(lambda: print(*[l for l in open('/proc/self/status') if l.startswith('VmHWM')],"
            " file=sys.stderr))\n"
            "from producers.cli import main\n"
            "main()\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_a_line_over_the_limit_is_skipped_without_being_held(redis_server, tmp_path):
    """Peak memory of the CLI on a file with a 48 MiB line, against the same file with a short
    line in its place: the long line is read in bounded pieces and dropped, never held."""

    def peak_kib(pad: int) -> int:
        in_path, out_path = tmp_path / "in.jsonl", tmp_path / f"out-{pad}.jsonl"
        with in_path.open("wb") as f:
            f.write(b'{"prompt": 5, "metadata": {"pad": "')
            for _ in range(pad // 2**20):
                f.write(b"x" * 2**20)
            f.write(b'x"}}\n[]\n')
        command = [sys.executable, "-c", PEAK_CLI, *bulk_command(in_path, out_path, redis_server)[3:], "--timeout", "5"]
        run = subprocess.run(command, env=bulk_env(), capture_output=True, text=True, timeout=60)
        assert run.returncode == 1, run.stderr  # two invalid rows
        rows = [json.loads(r) for r in out_path.read_text().splitlines()]
        assert [(r["line"], r["status"]) for r in rows] == [(1, "invalid"), (2, "invalid")]
        (peak,) = [line.split()[1] for line in run.stderr.splitlines() if line.startswith("VmHWM")]
        return int(peak)

    short, long = peak_kib(0), peak_kib(48 * 2**20)
    print(f"peak RSS: {short} KiB with a short line, {long} KiB with a 48 MiB one")
    assert (long - short) * 1024 < 8 * 2**20, f"peak RSS {short} KiB with a short line, {long} KiB with a long one"
