"""Least-privilege Redis ACL roles for producers, workers and gateways (PROTOCOL.md, "Security and ACLs").

A role is data: the commands each kind of key needs, under one prefix. ``setuser_args``
renders a role as the arguments of ``ACL SETUSER`` for a Redis major version:

    admin.execute_command("ACL", "SETUSER", *setuser_args(PRODUCER, "sluiceway", 7, "pw"))

On Redis 7 each grant becomes a selector, so a command is allowed only on the keys of its
own grant, and key permissions are read/write-specific (``%R~`` / ``%W~``): a producer can
append to a queue stream but not read it. Redis 6.2 has neither, so there the grants merge
into one rule (every command on every key of the role): PROTOCOL.md says what that leaves.

``cluster=True`` renders a role for the cluster layout (``--queue-shards N`` over
``redis+cluster://``): its key patterns also match the hash-tagged names (``{prefix}:{sK}:...``)
and it gains the commands a cluster client sends to learn the slots.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from producers.celery_app import CELERY_QUEUE
from producers.protocol import Keys


@dataclass(frozen=True)
class Grant:
    """Commands allowed on keys (patterns with ``{prefix}`` filled in), by access on Redis 7:
    ``rw`` read-write, ``r`` read only, ``w`` write only (append, delete, overwrite, and read
    metadata such as a stream's length, but not the data). One command's keys must all fall
    within one grant."""

    commands: tuple[str, ...]
    rw: tuple[str, ...] = ()
    r: tuple[str, ...] = ()
    w: tuple[str, ...] = ()

    def key_rules(self, prefix: str, major: int) -> list[str]:
        """``~pat`` / ``%R~pat`` / ``%W~pat`` rules; before Redis 7 every key is ``~pat``."""
        rules = []
        for marker, patterns in (("~", self.rw), ("%R~", self.r), ("%W~", self.w)):
            for pattern in patterns:
                rules.append(f"{marker if major >= 7 else '~'}{pattern.format(prefix=prefix)}")
        return rules


@dataclass(frozen=True)
class Role:
    """A Redis user's permissions: keyless ``commands``, ``grants`` on keys, pub/sub ``channels``."""

    name: str
    commands: tuple[str, ...]
    grants: tuple[Grant, ...]
    channels: tuple[str, ...] = ()
    cluster_commands: tuple[str, ...] = ()  # beyond CLUSTER_COMMANDS, on the cluster layout only
    cluster_grants: tuple[Grant, ...] = ()

    def for_cluster(self) -> "Role":
        """The role on the cluster layout: every pattern under the prefix also matches the same
        name with a hash tag after the prefix (``{prefix}:{*}:job:*``), plus the cluster's own
        commands and grants (PROTOCOL.md, "The cluster layout")."""
        grants = tuple(Grant(g.commands, _tagged(g.rw), _tagged(g.r), _tagged(g.w))
                       for g in self.grants + self.cluster_grants)
        return replace(self, commands=self.commands + CLUSTER_COMMANDS + self.cluster_commands, grants=grants,
                       cluster_commands=(), cluster_grants=())

    def patterns(self, prefix: str) -> list[str]:
        """Every key pattern of the role, for ``prefix``, in order and without repeats."""
        found: list[str] = []
        for grant in self.grants:
            for pattern in (*grant.rw, *grant.r, *grant.w):
                name = pattern.format(prefix=prefix)
                if name not in found:
                    found.append(name)
        return found


# Commands every client needs to connect and stay connected (redis-py: HELLO, AUTH, SELECT
# for a database in the URL, CLIENT SETNAME, PING health checks). CLIENT SETINFO (Redis 7.2+)
# is left out on purpose: redis-py ignores its refusal.
CONNECTION = ("ping", "hello", "auth", "select", "client|setname", "client|getname")
# redis-py's Script runs EVALSHA and, when Redis does not know the script yet, SCRIPT LOAD
# (SCRIPT EXISTS first in a pipeline). EVAL itself is not needed.
SCRIPTS = ("script|load", "script|exists")

JOB, QUEUE, DONE, TOKENS, CANCEL = ("{prefix}:job:*", "{prefix}:queue:*", "{prefix}:done:*",
                                   "{prefix}:tokens:*", "{prefix}:cancel:*")
DEAD, WORKERS = "{prefix}:dead", "{prefix}:workers"
LAYOUT = "{prefix}:layout"  # the cluster layout's shard count, recorded by the first worker
UNSHARDED = (WORKERS, LAYOUT)  # no hash tag in either layout
# NOTE: a cluster client asks any node for the slot map (CLUSTER SLOTS, or SHARDS) and the
# command table (COMMAND, COMMAND GETKEYS for keys it cannot place itself) on connect and
# after a MOVED; READONLY is sent only to replicas read from. None of them shows data.
CLUSTER_COMMANDS = ("cluster|slots", "cluster|shards", "cluster|nodes", "cluster|info", "cluster|keyslot",
                    "cluster|myid", "command", "readonly", "readwrite", "asking")

# NOTE: EVALSHA is checked against the keys a script declares as if it read and wrote them
# all (Redis 7 cannot tell what a script does), so the submit and cancel scripts need
# read-write on the queue streams in that one grant. Each command a script runs is checked
# on its own against every grant, and no grant lets a producer read a queue stream.
PRODUCER = Role(
    name="producer",
    commands=CONNECTION + SCRIPTS,
    grants=(
        Grant(("evalsha",), rw=(JOB, QUEUE, DONE, TOKENS, CANCEL)),
        # job hashes: created and cancelled by the scripts, read by status, result and bulk
        Grant(("exists", "hget", "hgetall", "hmget", "hset", "expire"), rw=(JOB,)),
        # queue streams: append only (XLEN is metadata); no reading, no XDEL, no groups
        Grant(("xadd", "xlen"), w=(QUEUE,)),
        # the submit script clears a fresh id's signal keys in one DEL
        Grant(("del",), rw=(DONE, TOKENS), w=(CANCEL,)),
        # done signals: waited on without consuming (BLMOVE), or BLPOP and RPUSH back (bulk)
        Grant(("blmove", "blpop", "rpush", "expire"), rw=(DONE,)),
        # token streams: read by stream(), closed by the cancel of a queued streaming job
        Grant(("xread", "xadd", "expire"), rw=(TOKENS,)),
        # cancel requests: set, never read
        Grant(("set",), w=(CANCEL,)),
        # worker heartbeats, for the status overview (they hold no job ids)
        Grant(("hgetall", "hget"), r=(WORKERS,)),
    ),
)

WORKER_GRANTS = (
    Grant(("evalsha",), rw=(JOB, DONE, TOKENS, CANCEL, QUEUE, DEAD)),
    # queue streams through the consumer group; dead letters are appended (by the scripts)
    Grant(("xgroup|create", "xreadgroup", "xautoclaim", "xclaim", "xack", "xdel", "xlen", "xpending", "xadd",
           "type"), rw=(QUEUE, DEAD)),
    Grant(("exists", "hget", "hmget", "hset", "hsetnx", "hincrby", "hdel", "expire"), rw=(JOB,)),
    # a job's end clears and expires its keys together; every script checks its keys' types first
    Grant(("del", "exists", "expire", "type"), rw=(JOB, DONE, TOKENS, CANCEL)),
    Grant(("rpush",), rw=(DONE,)),
    # token streams: appended; measured (START) and read back (XRANGE) when a job resumes from one
    Grant(("xadd", "xlen", "xrange"), rw=(TOKENS,)),
    Grant(("mget",), rw=(CANCEL,)),
    # its own heartbeat, and the others' (a name in use, the fleet's size)
    # NOTE: HVALS only for workers of releases before HGETALL counted the fleet, through a rolling upgrade
    Grant(("hset", "hget", "hdel", "hgetall", "hvals"), rw=(WORKERS,)),
)
# NOTE: Celery's keys do not carry the protocol prefix: kombu's queue list (and its priority
# lists, "sluiceway" + a two-byte separator + a digit), the worker's control-mailbox list,
# kombu's unacked bookkeeping and bindings, and the result backend's task-meta keys; found by
# watching a worker run tasks and a revoke (MONITOR). The mailbox is a pattern subscription,
# which Redis checks literally: it names the database, {db}.
CELERY_KEYS = (CELERY_QUEUE, CELERY_QUEUE + "??[0-9]", CELERY_QUEUE + "@*.celery.pidbox*", "unacked",
               "unacked_index", "unacked_mutex", "_kombu.binding*", "celery-task-meta-*")
CELERY_GRANTS = (
    # kombu's binding refresh for the mailbox; the worker's take of a message (worker/celery_taking.py:
    # it waits with BLMOVE, then its script pops with RPOP and records the message as kombu does)
    Grant(("evalsha",), rw=CELERY_KEYS),
    Grant(("blmove", "rpop", "brpop", "llen", "lpush", "rpush", "hset", "hget", "hdel", "hvals", "zadd", "zrem", "zrange",
           "zrangebyscore", "zrevrangebyscore", "set", "get", "setex", "mget", "del", "exists", "expire",
           "pexpire", "sadd", "smembers", "srem"), rw=CELERY_KEYS),
)
CELERY_COMMANDS = ("multi", "exec", "discard", "publish", "psubscribe", "punsubscribe", "subscribe", "unsubscribe")
CELERY_CHANNELS = ("/{db}.celery.pidbox", "celery-task-meta-*")

# NOTE: the queue reader waits on a connection of its own and a stop releases it with CLIENT
# UNBLOCK (worker/waits.py); a worker holding that command could also end another client's
# blocking wait early, which every client of the protocol retries.
WAITS = ("client|id", "client|unblock")
# NOTE: on the cluster layout the cancel keys live in many slots, so a worker polls them with
# one GET each rather than one MGET, and it records (SET NX) and checks the layout key.
WORKER_CLUSTER_GRANTS = (Grant(("get",), rw=(CANCEL,)), Grant(("set", "get"), rw=(LAYOUT,)))
WORKER = Role(name="worker", commands=CONNECTION + SCRIPTS + ("time",) + WAITS + CELERY_COMMANDS,
              grants=WORKER_GRANTS + CELERY_GRANTS, channels=CELERY_CHANNELS, cluster_grants=WORKER_CLUSTER_GRANTS)
# A worker started with --no-celery (or whose Celery broker is another Redis).
WORKER_NO_CELERY = Role(name="worker-no-celery", commands=CONNECTION + SCRIPTS + ("time",) + WAITS,
                        grants=WORKER_GRANTS, cluster_grants=WORKER_CLUSTER_GRANTS)

# NOTE: the gateway is a producer (its requests and its batches' lines are jobs) that also
# keeps the tenant limits' sorted sets and the Batch API's files and batches (keys:
# producers/protocol/batch_keys.py; PROTOCOL.md and docs/BATCHES.md), whose scripts (lease,
# move, cancel, answer, record) run HGET/HSET/HDEL/HINCRBY/SETBIT/RPUSH/GET/PEXPIRE/DEL on a batch's
# keys. A batch's collect deletes each ended job's hash, done list and token stream in one DEL.
OUTSTANDING = "{prefix}:gateway:*"
FILE, FILES, BATCH, BATCHES = "{prefix}:file:*", "{prefix}:files:*", "{prefix}:batch:*", "{prefix}:batches:*"
EXPIRING_FILES = "{prefix}:expiring-files"
GATEWAY_GRANTS = (
    Grant(("evalsha",), rw=(JOB, QUEUE, DONE, TOKENS, CANCEL, BATCH)),
    # tenant limits: one MULTI of ZREMRANGEBYSCORE ZADD ZCARD EXPIRE, then ZREM
    Grant(("zremrangebyscore", "zadd", "zcard", "zrem", "expire"), rw=(OUTSTANDING,)),
    # a file's hash and its bytes (uploads append a chunk at a time; reads take ranges)
    Grant(("hset", "hget", "hgetall", "append", "getrange", "del"), rw=(FILE,)),
    # a tenant's files and batches by time; the active set the feeders scan
    Grant(("zadd", "zcard", "zrem", "zrank", "zrevrank", "zrange", "zrevrange"), rw=(FILES, BATCHES)),
    Grant(("sadd", "smembers", "sismember", "srem"), rw=(BATCHES,)),
    # the files with an expiry, by when the feeders' sweep looks at them next
    Grant(("zadd", "zrem", "zrangebyscore"), rw=(EXPIRING_FILES,)),
    # a batch's hash, lease, pending lines, answered bitmap, duplicates, output and error lists
    Grant(("hset", "hsetnx", "hget", "hgetall", "hmget", "hlen", "hdel", "hincrby", "set", "get", "pexpire", "del",
           "getbit", "setbit", "rpush", "lrange", "llen"), rw=(BATCH,)),
    Grant(("del",), rw=(JOB, DONE, TOKENS)),
)
GATEWAY = Role(name="gateway", commands=CONNECTION + SCRIPTS + ("multi", "exec", "discard") + WAITS,
               grants=PRODUCER.grants + GATEWAY_GRANTS)

ROLES = {role.name: role for role in (PRODUCER, WORKER, WORKER_NO_CELERY, GATEWAY)}


def _tagged(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """``patterns`` and, for each under the prefix but the unsharded ones, its hash-tagged twin."""
    out = list(patterns)
    for pattern in patterns:
        if pattern.startswith("{prefix}:") and pattern not in UNSHARDED:
            out.append("{prefix}:{{*}}:" + pattern.removeprefix("{prefix}:"))
    return tuple(out)


def password_rule(password: str) -> str:
    """The ACL rule for a password, as its SHA-256 (``#...``), so no rule shows it in clear."""
    if not password:
        raise ValueError("password must not be empty (an ACL user without one is open to anyone)")
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def _commands(commands: tuple[str, ...]) -> list[str]:
    return [f"+{command}" for command in commands]


def setuser_args(role: Role, prefix: str, major: int, password: str, user: str | None = None,
                 db: int = 0, cluster: bool = False) -> list[str]:
    """``ACL SETUSER`` arguments (user name first) that make ``user`` (default: the role's
    name) exactly ``role`` under ``prefix`` on a Redis of major version ``major`` (6 or 7+);
    ``db`` is the database clients select (Celery's mailbox channel names it); ``cluster``:
    the role on the cluster layout (run the command on every master)."""
    Keys(prefix, 1 if cluster else 0)  # the same check as every client's
    if cluster:
        role = role.for_cluster()
    if major < 6:
        raise ValueError(f"Redis major version must be 6 or later (ACLs came with 6), got {major}")
    # NOTE: CLUSTER SHARDS came with Redis 7; a 6.2 server refuses a rule naming it
    keyless = tuple(c for c in role.commands if major >= 7 or c != "cluster|shards")
    args = [user or role.name, "reset", "on", password_rule(password), "resetchannels",
            *(f"&{channel.format(db=db)}" for channel in role.channels), *_commands(keyless)]
    if major < 7:
        commands: list[str] = []
        for grant in role.grants:
            commands += [c for c in _commands(grant.commands) if c not in commands]
        return args + commands + [f"~{pattern}" for pattern in role.patterns(prefix)]
    for grant in role.grants:
        args.append("(" + " ".join(_commands(grant.commands) + grant.key_rules(prefix, major)) + ")")
    return args


def setuser_line(role: Role, prefix: str, major: int, password: str, user: str | None = None,
                 db: int = 0, cluster: bool = False) -> str:
    """``setuser_args`` as one ``ACL SETUSER`` command line for redis-cli (selectors quoted)."""
    args = setuser_args(role, prefix, major, password, user, db, cluster)
    quoted = [f'"{a}"' if " " in a else a for a in args]
    return "ACL SETUSER " + " ".join(quoted)
