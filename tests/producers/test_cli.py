"""The ``sluiceway`` CLI's producer commands, and that none of them pulls in torch."""

import json
import re
import subprocess
import sys

from click.testing import CliRunner

from producers.cli import cli
from producers.protocol import Keys, parse_job
from tests.producers.peer import HandWorker

K = Keys("sluiceway")


def invoke(redis_server, *args, input=None):
    runner = CliRunner()
    return runner.invoke(cli, list(args), input=input, env={"SLUICEWAY_REDIS_URL": redis_server},
                         auto_envvar_prefix="SLUICEWAY")


def test_submit_status_cancel(redis_server, peer):
    res = invoke(redis_server, "submit", "hello", "-p", "max_tokens=8", "-p", "temperature=0",
                 "--metadata", '{"row": 1}', "--priority", "2")
    assert res.exit_code == 0, res.output
    job_id = res.output.strip()
    (_, fields), = peer.redis.xrange(K.queue("interactive"))
    job = parse_job(fields["job"])
    assert job.id == job_id and job.sampling["max_tokens"] == 8 and job.sampling["temperature"] == 0
    assert job.metadata == {"row": 1} and job.priority == 2

    res = invoke(redis_server, "status", job_id)
    assert res.exit_code == 0 and "queued" in res.output
    assert json.loads(invoke(redis_server, "status", job_id, "--json").output)["status"] == "queued"

    res = invoke(redis_server, "cancel", job_id)
    assert res.exit_code == 0 and "cancel requested" in res.output
    res = invoke(redis_server, "result", job_id, "--timeout", "1")  # queued: it ended at once
    assert res.exit_code == 1 and "cancelled" in res.output


def test_submit_wait_and_errors(redis_server, peer):
    with HandWorker(redis_server, queue="interactive"):
        res = invoke(redis_server, "submit", "-", "--wait", "--timeout", "10", input="from stdin")
    assert res.exit_code == 0 and res.output.strip() == "FROM STDIN"
    res = invoke(redis_server, "submit", "x", "--sampling", '{"top_p": 2}')
    assert res.exit_code == 2 and "top_p must be in (0, 1]" in res.output
    res = invoke(redis_server, "status", "nope")
    assert res.exit_code == 1 and "unknown" in res.output
    res = invoke(redis_server, "submit", "x", "--wait", "--timeout", "0.1")
    assert res.exit_code == 3 and "did not end within" in res.output


def test_bulk_command(redis_server, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "a", "metadata": {"k": 1}}\n{"prompt": 5}\n')
    with HandWorker(redis_server):
        res = invoke(redis_server, "bulk", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress")
    assert res.exit_code == 1, res.output  # one invalid row
    assert "2 rows: 1 done, 0 failed, 1 invalid" in res.output
    assert "line 2: prompt: expected a string, got the integer 5" in res.output
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[0]["text"] == "A" and out[0]["metadata"] == {"k": 1} and out[1]["status"] == "invalid"


def test_the_producer_group_holds_only_producer_commands(redis_server):
    """``worker``, ``bench`` and ``demo`` are the ``sluiceway`` command's (tests/sluiceway/test_cli.py)."""
    res = invoke(redis_server, "--help")
    assert res.exit_code == 0
    listed = [line.split()[0] for line in res.output.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == ["acl", "bulk", "cancel", "result", "status", "submit"]


def test_producers_never_import_torch():
    code = (
        "import sys; import producers, producers.protocol, producers.client, producers.aio, producers.cli,"
        " producers.bulk, producers.jobs, producers.errors, producers.celery_app\n"
        "from click.testing import CliRunner\n"
        "for args in (['--help'], ['submit', '--help'], ['bulk', '--help']):\n"
        "    assert CliRunner().invoke(producers.cli.cli, args).exit_code == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_status_without_an_id_shows_queues_and_workers(redis_server, peer):
    import time

    from producers.protocol import WorkerInfo

    invoke(redis_server, "submit", "a")
    invoke(redis_server, "submit", "b", "--queue", "bulk")
    peer.redis.xgroup_create(K.queue("bulk"), "workers", id="0")
    peer.redis.xreadgroup("workers", "gpu-1", {K.queue("bulk"): ">"})
    now = time.time()
    info = WorkerInfo(name="gpu-1", host="h", pid=7, queues=["interactive", "bulk"], model="tiny",
                      started_at=now, last_seen=now, stale_after_s=60, in_flight=1, capacity=31)
    peer.redis.hset(K.workers, "gpu-1", info.model_dump_json())
    res = invoke(redis_server, "status")
    assert res.exit_code == 0, res.output
    assert "bulk: 1 not ended, 1 held by workers" in res.output
    assert "interactive: 1 not ended, 0 held" in res.output
    assert "gpu-1 (h, pid 7) running: model tiny" in res.output
    data = json.loads(invoke(redis_server, "status", "--json").output)
    assert data["workers"][0]["alive"] and {q["name"] for q in data["queues"]} == {"bulk", "interactive"}
    assert "unreadable" not in data and "not heartbeats" not in res.output  # said only when there are some


def test_status_names_a_record_that_is_no_heartbeat_and_shows_the_rest(redis_server, peer):
    """The overview and ``Client.workers`` read the hash as the gateway does (``producers.heartbeats``):
    a record that is no heartbeat is skipped and named; a draining worker is fresh, a silent one is not."""
    import time

    from producers.client import Client
    from producers.protocol import WorkerInfo

    now = time.time()

    def record(name: str, state: str = "running", seen: float = now) -> str:
        return WorkerInfo(name=name, host="h", pid=7, queues=["bulk"], model="tiny", state=state,
                          started_at=seen, last_seen=seen, stale_after_s=60).model_dump_json()

    peer.redis.hset(K.workers, mapping={"gpu-1": record("gpu-1"), "gpu-2": record("gpu-2", "draining"),
                                        "gpu-3": record("gpu-3", seen=now - 600), "notes": "hand-written"})
    res = invoke(redis_server, "status")
    assert res.exit_code == 0, res.output  # was 1: a ValidationError for the whole fleet
    assert "gpu-1 (h, pid 7) running: model tiny" in res.output
    assert "gpu-2 (h, pid 7) draining: model tiny" in res.output
    assert re.search(r"gpu-3 \(h, pid 7\) silent for 60\ds \(dead\?\): model tiny", res.output), res.output
    assert "not heartbeats (skipped): notes in sluiceway:workers" in res.output
    data = json.loads(invoke(redis_server, "status", "--json").output)
    assert [(w["name"], w["alive"]) for w in data["workers"]] == [("gpu-1", True), ("gpu-2", True), ("gpu-3", False)]
    assert data["unreadable"] == ["notes"]
    with Client(redis_server) as client:
        assert [w.name for w in client.workers()] == ["gpu-1", "gpu-2", "gpu-3"]
        assert [w.live for w in client.fleet().workers] == [True, False, False]


def test_bulk_refuses_an_output_in_a_folder_that_does_not_exist_before_submitting(redis_server, tmp_path):
    import redis

    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n')
    missing = tmp_path / "no-such-folder"
    for extra in ([str(missing / "out.jsonl")],
                  [str(tmp_path / "out.jsonl"), "--format", "openai", "--errors", str(missing / "err.jsonl")]):
        result = CliRunner().invoke(cli, ["bulk", str(tmp_path / "in.jsonl"), *extra, "--redis", redis_server])
        assert result.exit_code == 2, result.output
        assert f"the folder '{missing}' does not exist" in result.output
    assert redis.Redis.from_url(redis_server).dbsize() == 0  # nothing was submitted


def test_bad_option_values_are_one_usage_error_before_anything_is_submitted(redis_server, tmp_path):
    import redis

    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n')
    bulk = ["bulk", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress"]
    cases = [  # each was a traceback (exit 1), or a job enqueued and then a timeout (exit 3) or invalid rows
        (["submit", "--token-ids", "1,a"], "'a' is not an integer"),
        (["submit", "x", "--sampling", "[1]"], "--sampling: must be a JSON object"),
        (["submit", "x", "--sampling", "[1]", "-p", "top_p=1"], "--sampling: must be a JSON object"),
        (["submit", "x", "--metadata", "[1]"], "metadata: expected an object, got an array"),
        (["submit", "x", "--queue", "no spaces"], "--queue: queue name must be"),
        (["submit", "x", "--prefix", "no spaces"], "prefix must be a non-empty word"),
        (["submit", "x", "--redis", "nowhere:6379"], "Redis URL must specify"),
        (["submit", "x", "--wait", "--timeout", "-1"], "'--timeout': -1.0 is not a number of seconds >= 0"),
        (["submit", "x", "--stream", "--timeout", "nan"], "'--timeout': nan is not a number of seconds >= 0"),
        (["result", "some-id", "--timeout", "nan"], "'--timeout': nan is not a number of seconds >= 0"),
        ([*bulk, "--job-timeout", "nan"], "'--job-timeout': nan is not a number of seconds > 0"),
        ([*bulk, "--job-timeout", "0"], "'--job-timeout': 0.0 is not a number of seconds > 0"),
        ([*bulk, "--timeout", "-5"], "'--timeout': -5.0 is not a number of seconds >= 0"),
        ([*bulk, "--queue", "no spaces"], "--queue: queue name must be"),
        (["result", "bad id!"], "id 'bad id!' may hold only letters"),  # was "unknown", exit 1
        (["status", "bad id!"], "id 'bad id!' may hold only letters"),
        (["cancel", "fine-id", "x" * 300], "the limit is"),
    ]
    for args, words in cases:
        result = invoke(redis_server, *args)
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert words in result.output and "Error:" in result.output, (args, result.output)
    assert redis.Redis.from_url(redis_server).dbsize() == 0  # nothing was submitted


def test_a_redis_that_is_not_there_is_one_line_by_its_timeout():
    """``python -m producers.cli result ID --timeout 0.5`` with no Redis at the URL: one line naming
    the server, exit 1, within about the timeout (was a traceback, after the 30 s outage window)."""
    import time

    from worker.embedded_redis import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "producers.cli", "result", "some-id", "--timeout", "0.5",
                          "--redis", url], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("error: redis: ") and "Connection refused" in run.stderr
    assert time.monotonic() - started < 10
