"""deploy/kubernetes: the worker Deployment and KEDA's ScaledObject hold the fields Kubernetes
and KEDA require, point at each other, and name the protocol's streams and consumer group."""

from __future__ import annotations

from pathlib import Path

import yaml

from producers.protocol import CONSUMER_GROUP, DEFAULT_QUEUES, Keys
from worker.settings import WorkerSettings


DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def documents() -> list[dict]:
    docs = [d for path in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        for field in ("apiVersion", "kind", "metadata"):
            assert field in doc, f"{doc.get('kind')}: no {field}"
        assert doc["metadata"].get("name"), f"{doc['kind']}: metadata.name is required"
    return docs


def one(kind: str) -> dict:
    found = [d for d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_the_worker_deployment_is_a_valid_deployment_of_the_worker():
    deployment = one("Deployment")
    assert deployment["apiVersion"] == "apps/v1"
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items(), "the selector must match the pod labels"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] and container["image"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert "SLUICEWAY_REDIS_URL" in env, "the worker reads its Redis URL from SLUICEWAY_REDIS_URL"
    settings = WorkerSettings(model="m", queues=env["SLUICEWAY_QUEUES"]["value"])
    grace = float(container["args"][container["args"].index("--grace-period") + 1])
    assert pod["terminationGracePeriodSeconds"] > grace, "Kubernetes must not kill a draining worker"
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    secret = one("Secret")
    for ref in [e["valueFrom"]["secretKeyRef"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert settings.queues == DEFAULT_QUEUES


def test_keda_scales_the_deployment_on_the_lag_of_the_workers_group():
    scaled, deployment = one("ScaledObject"), one("Deployment")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    target = scaled["spec"]["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"] and target.get("kind", "Deployment") == "Deployment"
    spec = scaled["spec"]
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    triggers = spec["triggers"]
    assert {t["metadata"]["stream"] for t in triggers} == {Keys().queue(q) for q in DEFAULT_QUEUES}
    auth = one("TriggerAuthentication")
    secret = one("Secret")
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["parameter"] in ("username", "password")
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert all(isinstance(v, str) for v in meta.values()), "KEDA reads every metadata value as a string"
        assert meta.get("address") or meta.get("addressFromEnv") or meta.get("host"), "the scaler needs an address"
        host, _, port = meta["address"].rpartition(":")
        assert host and port.isdigit(), "address is host:port, not a URL"
        assert meta["consumerGroup"] == CONSUMER_GROUP
        assert int(meta["lagCount"]) > 0 and "activationLagCount" in meta, "lag scaling needs both"
        assert "pendingEntriesCount" not in meta and "streamLength" not in meta, "one scaling mode per trigger"
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
