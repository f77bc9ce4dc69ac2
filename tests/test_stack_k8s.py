"""deploy/k8s, checked structurally: every resource kustomize lists exists and parses, images are
pinned, the agent sidecar shares the worker's memory-backed ring, the PodMonitor finds the
sidecar's port, and the node collectors reach the gateways. With kubernetes-validate installed,
the core resources are also validated against the Kubernetes 1.30 schemas."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from otelcol_env import with_defaults

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())
NAMESPACE = KUSTOMIZATION["namespace"]
FILES = [K8S / r for r in KUSTOMIZATION["resources"]]
DOCS = [d for f in FILES if f.is_file() for d in yaml.safe_load_all(f.read_text()) if d]


PINNED = re.compile(
    r"^[\w./-]+:(?!latest$)v?\d[\w.-]*(@sha256:[0-9a-f]{64})?$|^[\w./-]+@sha256:[0-9a-f]{64}$"
)


def pinned(image: str) -> bool:
    """A version tag starting with a digit (or v+digit), or a digest; never `latest` or bare."""
    return bool(PINNED.match(image))


def find(kind: str, name: str) -> dict:
    for d in DOCS:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name} in {[f.name for f in FILES]}")


def pod_containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_resources_exist():
    """Every file kustomize lists exists and holds at least one resource."""
    for f in FILES:
        assert f.is_file(), f
        assert any(yaml.safe_load_all(f.read_text())), f


def test_generated_files_are_fresh():
    """deploy/k8s/generated/ matches exporters/fleet and deploy/prometheus/rules."""
    r = subprocess.run(
        [sys.executable, str(K8S / "render.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_images_pinned():
    """Every container image names a version tag."""
    images = [
        c["image"] for d in DOCS if "template" in d.get("spec", {}) for c in pod_containers(d)
    ]
    assert images
    for image in images:
        assert pinned(image), image


def test_agent_sidecar_shares_the_memory_ring():
    """The worker runs in agent mode; the agent sidecar (a native sidecar: an init container with
    restartPolicy Always) mounts the same emptyDir, medium Memory, at MEMRA_OBS_AGENT."""
    dep = find("Deployment", "memra-worker")
    spec = dep["spec"]["template"]["spec"]
    worker = next(c for c in spec["containers"] if c.get("args") == ["demo"])
    agent = next(c for c in spec["initContainers"] if c.get("args") == ["agent"])
    assert agent["restartPolicy"] == "Always"
    ring_dir = env(worker)["MEMRA_OBS_AGENT"]
    assert env(agent)["MEMRA_OBS_AGENT"] == ring_dir
    vols = {v["name"]: v for v in spec["volumes"]}
    for c in (worker, agent):
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == ring_dir)
        assert vols[mount["name"]]["emptyDir"]["medium"] == "Memory"
    assert env(worker)["MEMRA_OBS_METRICS_ADDR"] == "", "the sidecar serves the pod's /metrics"


def test_metrics_leave_the_pod_only_over_tls_with_basic_auth():
    """The sidecar listens on the pod network, so it does what README "Serving /metrics" asks
    there: HTTPS and basic auth, from files of one mounted Secret, which the PodMonitor's
    https scrape and basicAuth read too (the port was open to the whole pod network)."""
    dep = find("Deployment", "memra-worker")
    spec = dep["spec"]["template"]["spec"]
    agent = next(c for c in spec["initContainers"] if c.get("args") == ["agent"])
    e = env(agent)
    assert e["MEMRA_OBS_METRICS_ADDR"].startswith("0.0.0.0:")
    files = [e[f"MEMRA_OBS_METRICS_{k}"] for k in ("TLS_CERT", "TLS_KEY", "BASIC_AUTH_FILE")]
    secret = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    mounts = [m for m in agent["volumeMounts"] if m["name"] in secret]
    assert len(mounts) == 1 and mounts[0].get("readOnly") is True
    (name,) = {secret[m["name"]] for m in mounts}
    assert all(f.startswith(mounts[0]["mountPath"].rstrip("/") + "/") for f in files), files
    assert "tcpSocket" in agent["readinessProbe"], "an httpGet probe would get 401"
    (ep,) = find("PodMonitor", "memra-worker")["spec"]["podMetricsEndpoints"]
    assert ep["scheme"] == "https"
    assert ep["tlsConfig"]["ca"]["secret"]["name"] == name and ep["tlsConfig"]["serverName"]
    assert {ep["basicAuth"][k]["name"] for k in ("username", "password")} == {name}


def test_podmonitor_scrapes_the_agent_port():
    """The PodMonitor selects the worker pods and names a port the agent serves /metrics on."""
    pm = find("PodMonitor", "memra-worker")
    dep = find("Deployment", "memra-worker")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: (c, p) for c in pod_containers(dep) for p in c.get("ports", [])}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        c, p = ports[ep["port"]]
        assert env(c)["MEMRA_OBS_METRICS_ADDR"].endswith(f":{p['containerPort']}")


def _collector_config(workload: dict) -> dict:
    spec = workload["spec"]["template"]["spec"]
    cm_name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    cm = find("ConfigMap", cm_name)
    c = spec["containers"][0]
    config_path = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--config="))
    mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    return with_defaults(yaml.safe_load(cm["data"][config_path[len(mount["mountPath"]) + 1 :]]))


def test_collectors_listen_where_they_are_sent_to():
    """The node collector's hostPorts are its OTLP receivers (where the agent sends); its
    load_balancing exporter resolves the gateways' headless Service on a port they listen on."""
    ds = find("DaemonSet", "memra-collector-agent")
    cfg = _collector_config(ds)
    host_ports = {
        p["hostPort"]
        for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]
        if "hostPort" in p
    }
    receivers = {
        int(v["endpoint"].rsplit(":", 1)[1]) for v in cfg["receivers"]["otlp"]["protocols"].values()
    }
    assert receivers <= host_ports
    sidecar = next(
        c for c in pod_containers(find("Deployment", "memra-worker")) if c.get("args") == ["agent"]
    )
    assert env(sidecar)["OTEL_EXPORTER_OTLP_ENDPOINT"].rsplit(":", 1)[1] in {
        str(p) for p in host_ports
    }

    dns = cfg["exporters"]["load_balancing"]["resolver"]["dns"]
    svc_name, ns = dns["hostname"].split(".")[:2]
    assert ns == NAMESPACE
    svc = find("Service", svc_name)
    assert svc["spec"]["clusterIP"] == "None", "load_balancing needs one DNS record per gateway pod"
    gw = find("Deployment", "memra-collector-gateway")
    assert svc["spec"]["selector"].items() <= gw["spec"]["template"]["metadata"]["labels"].items()
    assert dns["port"] in {p["port"] for p in svc["spec"]["ports"]}
    gw_cfg = _collector_config(gw)
    assert dns["port"] == int(
        gw_cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    )


def test_prometheus_rule_matches_the_rule_files():
    """The PrometheusRule carries exactly the groups of deploy/prometheus/rules."""
    rule = find("PrometheusRule", "memra-obs")
    groups = [
        g
        for f in sorted((ROOT / "deploy/prometheus/rules").glob("*.rules.yml"))
        for g in yaml.safe_load(f.read_text())["groups"]
    ]
    assert rule["spec"]["groups"] == groups


@pytest.mark.skipif(
    importlib.util.find_spec("kubernetes_validate") is None,
    reason="kubernetes-validate not installed",
)
def test_core_resources_validate_against_kubernetes_schemas():
    """Strict schema validation of the built-in kinds (the CRDs have no schema there)."""
    import kubernetes_validate

    for d in DOCS:
        if "monitoring.coreos.com" in d["apiVersion"]:
            continue
        kubernetes_validate.validate(d, "1.30.0", strict=True)
