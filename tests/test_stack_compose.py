"""deploy/compose.yaml, checked structurally (there is no Docker engine here to run it): images
pinned, mounted files present, every host:port a config names is a port that service listens on,
and the workers share the agent's memory-backed ring volume."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from otelcol_env import with_defaults

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]

# What the images listen on without a config of ours (their documented defaults).
IMAGE_PORTS = {"jaeger": {4317, 4318, 16686}, "prometheus": {9090}, "grafana": {3000}}

PINNED = re.compile(r"^[\w./-]+(:(?!latest$)v?\d[\w.-]*)?(@sha256:[0-9a-f]{64})?$")


def pinned(image: str) -> bool:
    """A version tag starting with a digit (or v+digit), or a digest; never `latest` or bare."""
    return bool(PINNED.match(image)) and (":" in image or "@sha256:" in image)


def _expand(value: str) -> str:
    """`${VAR:-default}` -> default (the value compose uses when VAR is unset)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def mounts(svc: dict) -> list[tuple[str, str]]:
    """(source, target) of each short-syntax volume entry."""
    out = []
    for v in svc.get("volumes", []):
        src, target = _expand(v).split(":")[:2]
        out.append((src, target))
    return out


def bind_source(svc: dict, target: str) -> Path:
    for src, tgt in mounts(svc):
        if tgt == target:
            return (DEPLOY / src).resolve()
    raise AssertionError(f"nothing mounted at {target}")


def command_flag(svc: dict, flag: str) -> str:
    for arg in svc.get("command", []):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"no {flag}= in {svc.get('command')}")


def collector_config(name: str) -> dict:
    svc = SERVICES[name]
    return with_defaults(
        yaml.safe_load(bind_source(svc, command_flag(svc, "--config")).read_text())
    )


def listens(name: str) -> set[int]:
    """The ports service `name` listens on, from its own config where it has one."""
    svc = SERVICES[name]
    if name in IMAGE_PORTS:
        return IMAGE_PORTS[name]
    if "otel/opentelemetry-collector" in svc["image"]:
        cfg = collector_config(name)
        ports = {int(e["endpoint"].rsplit(":", 1)[1]) for e in _endpoints(cfg.get("receivers", {}))}
        ports |= {
            int(e["endpoint"].rsplit(":", 1)[1]) for e in cfg.get("extensions", {}).values() if e
        }
        for reader in cfg["service"].get("telemetry", {}).get("metrics", {}).get("readers", []):
            ports.add(reader["pull"]["exporter"]["prometheus"]["port"])
        return ports
    addr = svc.get("environment", {}).get("MEMRA_OBS_METRICS_ADDR", "")
    return {int(addr.rsplit(":", 1)[1])} if addr else set()


def _endpoints(tree) -> list[dict]:
    """Every mapping with an `endpoint` key, anywhere under `tree`."""
    out = []
    if isinstance(tree, dict):
        if "endpoint" in tree:
            out.append(tree)
        for v in tree.values():
            out += _endpoints(v)
    return out


def references() -> list[tuple[str, str, int]]:
    """(what, service, port) for every host:port the stack's configs point at."""
    refs = []
    prom = yaml.safe_load(
        bind_source(SERVICES["prometheus"], "/etc/prometheus")
        .joinpath("prometheus.yml")
        .read_text()
    )
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                refs.append(
                    (
                        f"prometheus job {job['job_name']}",
                        "prometheus" if host == "localhost" else host,
                        int(port),
                    )
                )
    prov = bind_source(SERVICES["grafana"], "/etc/grafana/provisioning")
    for f in (prov / "datasources").glob("*.yaml"):
        for ds in yaml.safe_load(f.read_text())["datasources"]:
            u = urlsplit(ds["url"])
            refs.append((f"grafana datasource {ds['name']}", u.hostname, u.port))
    for name, svc in SERVICES.items():
        if "otel/opentelemetry-collector" in svc["image"]:
            for exp_name, exp in collector_config(name).get("exporters", {}).items():
                url = (
                    exp.get("endpoint") or exp.get("metrics_endpoint") or exp.get("traces_endpoint")
                )
                url = url if "://" in url else f"grpc://{url}"
                u = urlsplit(url)
                refs.append((f"{name} exporter {exp_name}", u.hostname, u.port))
        otlp = svc.get("environment", {}).get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if otlp:
            u = urlsplit(otlp)
            refs.append((f"{name} OTEL_EXPORTER_OTLP_ENDPOINT", u.hostname, u.port))
    return refs


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_images_pinned(name: str):
    """Every image names a version tag or a digest."""
    assert pinned(SERVICES[name]["image"]), SERVICES[name]["image"]


def test_dockerfile_base_pinned():
    """The worker image's base is a version tag too."""
    froms = [
        ln.split()[1]
        for ln in (DEPLOY / "worker.Dockerfile").read_text().splitlines()
        if ln.startswith("FROM ")
    ]
    assert froms and all(pinned(f) for f in froms), froms
    for svc in SERVICES.values():
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()


def test_current_major_versions():
    """Jaeger v2 (v1's all-in-one is end-of-life), Grafana 11 (the dashboards' schema), Prometheus 3."""
    assert SERVICES["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    assert SERVICES["grafana"]["image"].startswith("grafana/grafana:11.")
    assert SERVICES["prometheus"]["image"].startswith("prom/prometheus:v3.")
    assert "collector-contrib" in SERVICES["otel-collector"]["image"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_volumes_exist(name: str):
    """Bind-mounted paths exist in the repository; named volumes are declared."""
    for src, _ in mounts(SERVICES[name]):
        if src.startswith((".", "/")):
            assert (DEPLOY / src).exists(), f"{name}: {src} does not exist"
        else:
            assert src in COMPOSE.get("volumes", {}), f"{name}: volume {src} not declared"


def test_every_reference_hits_a_listening_port():
    """Scrape targets, datasource URLs, collector exporters and OTLP endpoints all point at a
    service of this file, on a port that service listens on."""
    refs = references()
    assert len(refs) >= 8
    for what, host, port in refs:
        assert host in SERVICES, f"{what}: no service {host!r}"
        assert port in listens(host), (
            f"{what}: {host} does not listen on {port} ({sorted(listens(host))})"
        )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_published_ports_are_listened_on(name: str):
    """Every published or exposed container port is one the service listens on, and published
    ports bind 127.0.0.1 (Grafana runs with anonymous access)."""
    svc = SERVICES[name]
    for p in svc.get("ports", []):
        parts = p.split(":")
        assert parts[0] == "127.0.0.1", f"{name}: {p} is published beyond loopback"
        assert int(parts[-1]) in listens(name), f"{name}: publishes {p}"
    for p in svc.get("expose", []):
        assert int(p) in listens(name), f"{name}: exposes {p}"


def test_prometheus_features_and_rules():
    """Exemplar storage and the OTLP receiver are on; the config and rules are mounted."""
    prom = SERVICES["prometheus"]
    flags = prom["command"]
    assert "--enable-feature=exemplar-storage" in flags
    assert "--web.enable-otlp-receiver" in flags
    config = command_flag(prom, "--config.file")
    src = bind_source(prom, str(Path(config).parent))
    assert (src / Path(config).name).is_file()
    assert list((src / "rules").glob("*.rules.yml"))


def test_grafana_provisioning_paths():
    """The dashboard provider reads the folder the generated JSON is mounted at, and the home
    dashboard exists there."""
    g = SERVICES["grafana"]
    prov = bind_source(g, "/etc/grafana/provisioning")
    providers = [
        p
        for f in (prov / "dashboards").glob("*.yaml")
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    for p in providers:
        src = bind_source(g, p["options"]["path"])
        assert src == (ROOT / "grafana" / "dashboards").resolve()
        assert list(src.glob("*.json"))
    home = g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (bind_source(g, str(Path(home).parent)) / Path(home).name).is_file()


def test_workers_share_the_agent_ring():
    """Each demo worker runs in agent mode on the volume the agent reads, with its own worker
    label; the volume is tmpfs (memory-backed)."""
    agent = SERVICES["memra-agent"]
    ring_dir = agent["environment"]["MEMRA_OBS_AGENT"]
    ring_vol = next(src for src, tgt in mounts(agent) if tgt == ring_dir)
    assert COMPOSE["volumes"][ring_vol]["driver_opts"]["type"] == "tmpfs"
    workers = {n: s for n, s in SERVICES.items() if s.get("command") == ["demo"]}
    assert len(workers) >= 2
    labels = set()
    for name, w in workers.items():
        env = w["environment"]
        assert env["MEMRA_OBS_AGENT"] == ring_dir, name
        assert (ring_vol, ring_dir) in mounts(w), name
        assert env.get("MEMRA_OBS_METRICS_ADDR") == "", f"{name} should leave /metrics to the agent"
        labels.add(env["MEMRA_OBS_WORKER"])
    assert len(labels) == len(workers), "workers share a worker label"


def test_the_worker_image_build_copies_what_pyproject_names():
    """The image's context left LICENSE out: the wheel in the image shipped without it, and a
    license pattern matching nothing is a setuptools deprecation now, a build error later."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    copied = {
        src
        for ln in (DEPLOY / "worker.Dockerfile").read_text().splitlines()
        if ln.startswith("COPY ")
        for src in ln.split()[1:-1]
    }
    ignore = (DEPLOY / "worker.Dockerfile.dockerignore").read_text().splitlines()
    for f in (project["readme"], *project.get("license-files", [])):
        assert f in copied, f"{f} (pyproject.toml) is not COPY'd by worker.Dockerfile"
        keep = True  # the last matching .dockerignore line wins
        for ln in (x.strip() for x in ignore):
            pat = ln.lstrip("!").rstrip("/")
            if ln and not ln.startswith("#") and fnmatch.fnmatch(f, pat):
                keep = ln.startswith("!")
        assert keep, f"{f} is kept out of the build context by the .dockerignore"
