"""A private Redis Cluster of M masters on loopback (no replicas), from one ``redis-server`` binary:
for ``sluiceway bench fleet --cluster-masters M`` and the tests' local cluster.

The slots are assigned and the nodes introduced with the cluster commands themselves (``CLUSTER
SET-CONFIG-EPOCH``, ``ADDSLOTS``, ``MEET``), as ``redis-cli --cluster create`` does, so nothing
but ``redis-server`` is needed. Nothing here imports torch.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import redis

from producers.embedded_redis import EmbeddedRedis, free_port

SLOTS = 16384


def _info(reply) -> dict[str, str]:
    if isinstance(reply, bytes):
        reply = reply.decode()
    if isinstance(reply, str):
        return dict(line.split(":", 1) for line in reply.split() if ":" in line)
    return {str(k): str(v) for k, v in dict(reply).items()}


class EmbeddedCluster:
    """``masters`` cluster-enabled ``redis-server`` processes, each with an equal run of slots.

    ``url`` is the ``redis+cluster://`` URL of every master; ``nodes`` the ``EmbeddedRedis``
    handles (their plain ``url`` reaches one master alone, for ``INFO``). Killed at ``close``.
    """

    def __init__(self, masters: int = 3, work: str | Path | None = None, executable: str | None = None,
                 node_timeout_ms: int = 2000) -> None:
        if isinstance(masters, bool) or not isinstance(masters, int) or not 1 <= masters <= 64:
            raise ValueError(f"masters must be an integer from 1 to 64, got {masters!r}")
        self._own_work = work is None
        self.work = Path(work or tempfile.mkdtemp(prefix="sluiceway-cluster-")).resolve()
        self.nodes = [EmbeddedRedis(self.work / f"node-{i}", executable=executable) for i in range(masters)]
        # NOTE: the bus port is given, not port + 10000, which free ports above 55535 overflow
        # (``--cluster-port``, and MEET's third argument: Redis 7)
        self.bus_ports = [free_port() for _ in self.nodes]
        for node, bus in zip(self.nodes, self.bus_ports):
            node.extra_args = ["--cluster-enabled", "yes", "--cluster-config-file", str(node.data_dir / "nodes.conf"),
                               "--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(bus)]

    @property
    def urls(self) -> list[str]:
        """Each master's plain ``redis://`` URL."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> "EmbeddedCluster":
        """Start every master, split the slots evenly, and return once every node agrees."""
        try:
            for node in self.nodes:
                node.start()
            clients = [node.client(decode_responses=True) for node in self.nodes]
            try:
                self._form(clients, timeout)
            finally:
                for c in clients:
                    c.close()
        except BaseException:
            self.close()
            raise
        return self

    def _form(self, clients: list[redis.Redis], timeout: float) -> None:
        m = len(clients)
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)  # distinct epochs: no collision to settle
            first, last = i * SLOTS // m, (i + 1) * SLOTS // m - 1
            c.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
        for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
            clients[0].execute_command("CLUSTER", "MEET", node.host, node.port, bus)
        deadline = time.monotonic() + timeout
        while not all(self._ready(c) for c in clients):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {m} masters did not agree on their slots within {timeout}s")
            time.sleep(0.05)  # NOTE: gossip announces no event; the state is polled

    def _ready(self, c: redis.Redis) -> bool:
        info = _info(c.execute_command("CLUSTER", "INFO"))
        return (info.get("cluster_state") == "ok" and info.get("cluster_slots_ok") == str(SLOTS)
                and info.get("cluster_known_nodes") == str(len(self.nodes)))

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
            node.cleanup()
        if self._own_work:
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
