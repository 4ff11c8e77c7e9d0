"""A real gateway process as the ``gateway`` ACL user (tenant limits on) and a real worker as the
``worker-no-celery`` user, on Redis 7: a chat completion, a streamed one and a Batch (upload ->
batch -> output file) through the official ``openai`` client succeed with nothing refused, and
the role refuses what a gateway does not need."""

from __future__ import annotations

import json
import shlex
import signal

import openai
import pytest
import redis
from click.testing import CliRunner

from producers.acl import WORKER_NO_CELERY, setuser_args
from producers.cli import cli
from producers.protocol import Keys
from producers.protocol.batch_keys import BatchKeys
from tests.gateway.conftest import ALICE, TENANTS, GatewayProcess
from tests.redis_server import EmbeddedRedis, redis7_executable
from tests.worker.conftest import wait_for
from tests.worker.test_process import WorkerProcess

K, B = Keys(), BatchKeys()
ADMIN, GATEWAY_PW, WORKER_PW = "admin-secret", "gateway-secret", "worker-secret"
SHORT = {"temperature": 0, "max_tokens": 4}


class AclStack:
    def __init__(self, tiny_model, tmp_path) -> None:
        self.server = EmbeddedRedis(tmp_path / "redis", executable=redis7_executable(), password=ADMIN).start()
        self.admin = self.server.client(decode_responses=True)
        # the gateway's user from what `sluiceway acl gateway` prints, as an operator would apply it
        res = CliRunner().invoke(cli, ["acl", "gateway", "--password", GATEWAY_PW])
        assert res.exit_code == 0, res.output
        assert self.admin.execute_command(*shlex.split(res.output.strip())) == "OK"
        self.admin.execute_command("ACL", "SETUSER", *setuser_args(WORKER_NO_CELERY, K.prefix, 7, WORKER_PW))
        self.admin.execute_command("ACL", "LOG", "RESET")
        self.worker = WorkerProcess(tiny_model, tmp_path, "--name", "acl-gw-worker", "--served-model-name", "tiny",
                                    "--no-celery", redis_url=self.url("worker-no-celery", WORKER_PW))
        wait_for(lambda: "acl-gw-worker" in self.admin.hgetall(K.workers), timeout=120, what="the worker's heartbeat")
        self.gateway = GatewayProcess(tmp_path, self.url("gateway", GATEWAY_PW), *TENANTS,
                                      env={"SLUICEWAY_BATCH_POLL_SECONDS": "0.05",
                                           "SLUICEWAY_TENANT_MAX_OUTSTANDING": "alice=3"})

    def url(self, user: str, password: str) -> str:
        return f"redis://{user}:{password}@{self.server.host}:{self.server.port}/0"

    def refusals(self) -> list[tuple[str, str, str]]:
        """ACL LOG entries as (user, context, object), less redis-py's CLIENT SETINFO (ignored)
        and the cancel script's XDEL (a pcall)."""
        entries = [(e["username"], e["context"], e["object"]) for e in self.admin.execute_command("ACL", "LOG", "128")]
        return [e for e in entries if e[2] != "client" and e[2] != "xdel"]

    def close(self) -> None:
        self.gateway.stop(signal.SIGKILL)
        self.worker.stop(signal.SIGKILL)
        self.admin.close()
        self.server.cleanup()


@pytest.fixture(scope="module")
def acl_stack(tiny_model, tmp_path_factory):
    stack = AclStack(tiny_model, tmp_path_factory.mktemp("acl-gateway"))
    yield stack
    stack.close()


def test_a_gateway_user_serves_completions_streams_and_a_batch(acl_stack):
    client = acl_stack.gateway.client(ALICE)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], **SHORT)
    assert chat.usage.completion_tokens == 4 and chat.choices[0].message.content
    chunks = list(client.completions.create(model="tiny", prompt="Stream", stream=True, **SHORT))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": f"row {i}"}], **SHORT}}
            for i in range(3)]
    expiry = {"anchor": "created_at", "seconds": 3600}  # the sweep reads its schedule on every pass
    upload = client.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
                                 purpose="batch", expires_after=expiry)
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  output_expires_after=expiry)
    wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed", "expired"), timeout=120,
             what="the batch to end")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["row-0", "row-1", "row-2"]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert [f.id for f in client.files.list().data if f.id == upload.id] == [upload.id]
    client.files.delete(done.output_file_id)
    client.files.delete(upload.id)
    assert acl_stack.refusals() == []


def test_the_tenant_limit_holds_as_the_gateway_user(acl_stack):
    """The limit's sorted set is kept by the gateway user: entries past it are refused (429)."""
    key = K.outstanding("alice")
    acl_stack.admin.zadd(key, {f"held-{i}": 2e9 for i in range(3)})  # three unanswered: alice's limit
    try:
        with pytest.raises(openai.RateLimitError, match="tenant alice has 3 requests unanswered"):
            acl_stack.gateway.client(ALICE).completions.create(model="tiny", prompt="x", **SHORT)
    finally:
        acl_stack.admin.delete(key)
    assert acl_stack.refusals() == []


GATEWAY_REFUSED = {
    "flushall": lambda r: r.flushall(),
    "keys": lambda r: r.keys("*"),
    "scan": lambda r: r.scan(0),
    "config get": lambda r: r.config_get("requirepass"),
    "eval": lambda r: r.eval("return 1", 0),
    "a key outside the prefix is read": lambda r: r.get("elsewhere"),
    "a key outside the prefix is written": lambda r: r.set("elsewhere", "x"),
    "a queue is read": lambda r: r.xrange(K.queue("unread")),
    "a queue is taken": lambda r: r.xreadgroup("workers", "thief", {K.queue("unread"): ">"}),
    "a queue is dropped": lambda r: r.delete(K.queue("unread")),
    "a heartbeat is forged": lambda r: r.hset(K.workers, "fake", "{}"),
    "a batch's keys are listed": lambda r: r.execute_command("SCAN", "0", "MATCH", B.batch("*")),
    "a file is renamed": lambda r: r.rename(B.file("a"), B.file("b")),
}


@pytest.mark.parametrize("attack", list(GATEWAY_REFUSED))
def test_the_gateway_role_refuses(acl_stack, attack):
    acl_stack.admin.set("elsewhere", "kept")
    acl_stack.admin.xadd(K.queue("unread"), {"job": "{}"})
    r = redis.Redis.from_url(acl_stack.url("gateway", GATEWAY_PW))
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            GATEWAY_REFUSED[attack](r)
    finally:
        r.close()
    assert acl_stack.admin.get("elsewhere") == "kept" and acl_stack.admin.xlen(K.queue("unread")) > 0
