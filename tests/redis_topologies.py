"""Real multi-process Redis topologies for tests, from Redis 7's ``redis-server``: a primary with
a replica watched by three sentinels (``SentinelSet``), and a cluster of three masters
(``LocalCluster``, the ``EmbeddedCluster`` of ``producers/embedded_cluster.py``). Every process listens on loopback and is
killed at teardown."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from producers.embedded_cluster import EmbeddedCluster
from worker.embedded_redis import EmbeddedRedis, free_port

SERVICE = "sluiceway-test"


class SentinelSet:
    """A primary, one replica and three sentinels (quorum 2) that fail over within seconds.

    ``url`` is the ``redis+sentinel://`` URL of the service; ``kill_primary()`` kills -9 the
    current primary; ``wait_promoted()`` returns once the sentinels name another one.
    """

    def __init__(self, executable: str, work: Path, down_after_ms: int = 1000) -> None:
        self.executable = executable
        self.work = work
        self.down_after_ms = down_after_ms
        self.primary = EmbeddedRedis(work / "primary", executable=executable)
        self.replica = EmbeddedRedis(work / "replica", executable=executable)
        self.sentinel_ports = [free_port() for _ in range(3)]
        self._sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> "SentinelSet":
        self.primary.start()
        self.replica.extra_args = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        with self.replica.client() as probe:
            deadline = time.monotonic() + 20
            while probe.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica did not sync with the primary in 20 s")
                time.sleep(0.02)  # NOTE: no event announces the end of the first sync
        for port in self.sentinel_ports:
            folder = self.work / f"sentinel-{port}"
            folder.mkdir(parents=True, exist_ok=True)
            conf = folder / "sentinel.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", "protected-mode no", f"dir {folder}",
                f"logfile {folder / 'sentinel.log'}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                f"sentinel failover-timeout {SERVICE} 10000",
                f"sentinel parallel-syncs {SERVICE} 1", "",
            ]))
            # NOTE: Debian splits redis-sentinel into its own package; it is the same binary as
            # redis-server, which runs as a sentinel with --sentinel.
            self._sentinels.append(subprocess.Popen([self.executable, str(conf), "--sentinel"],
                                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL))
        self._wait(lambda: all(self._sees_replica(port) for port in self.sentinel_ports), 20,
                   "the sentinels to see the primary and its replica")
        return self

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)

    def _sees_replica(self, port: int) -> bool:
        try:
            with self._sentinel(port) as s:
                return any(r.get("name") for r in s.sentinel_slaves(SERVICE)) and \
                    len(s.sentinel_sentinels(SERVICE)) == 2
        except redis.RedisError:
            return False

    def primary_address(self) -> tuple[str, int]:
        with self._sentinel(self.sentinel_ports[0]) as s:
            host, port = s.sentinel_get_master_addr_by_name(SERVICE)
            return host, int(port)

    def kill_primary(self) -> None:
        self.primary.kill()

    def wait_promoted(self, timeout: float = 30) -> float:
        """Seconds until the sentinels name the replica as primary and it accepts writes."""
        started = time.monotonic()

        def promoted() -> bool:
            try:
                if self.primary_address()[1] != self.replica.port:
                    return False
                with self.replica.client(socket_timeout=2) as c:
                    return c.info("replication")["role"] == "master"
            except redis.RedisError:
                return False

        self._wait(promoted, timeout, "a sentinel failover to the replica")
        return time.monotonic() - started

    @staticmethod
    def _wait(predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.02)

    def close(self) -> None:
        for proc in self._sentinels:
            proc.kill()
            proc.wait(10)
        for server in (self.replica, self.primary):
            server.kill()
            server.cleanup()
        shutil.rmtree(self.work, ignore_errors=True)


class LocalCluster(EmbeddedCluster):
    """Three masters on loopback (``producers.embedded_cluster``, which the fleet bench builds too)."""

    def __init__(self, executable: str, work: Path) -> None:
        super().__init__(3, work, executable=executable)
