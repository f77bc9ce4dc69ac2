"""The tree stays ruff-clean (lint and format), as CI checks it."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["memra_obs", "tests", "bench", "grafana", "deploy"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e .[dev])")
    return [exe]


def test_ruff_check_is_clean():
    """No lint findings anywhere in the tree."""
    r = subprocess.run([*_ruff(), "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
    """Every file is as the formatter leaves it."""
    r = subprocess.run(
        [*_ruff(), "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_test_the_readme_names_exists():
    """The README's promises name the tests that hold them: a renamed or deleted test must not
    leave a promise pointing at nothing."""
    import re

    refs = set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", (ROOT / "README.md").read_text()))
    assert len(refs) > 50
    missing = [
        f"{path}::{name}"
        for path, name in sorted(refs)
        if not (ROOT / path).is_file()
        or not re.search(rf"^\s*(?:async )?def {name}\(", (ROOT / path).read_text(), re.M)
    ]
    assert not missing, missing


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def test_the_readme_extras_table_is_pyproject_s():
    """The README's extras table names every extra of pyproject.toml and, but for `dev`, exactly
    the distributions each one pulls: `pip install 'memra_obs[gpu]'` must not bring a CUDA-12
    CuPy the table does not name, nor `[otlp]` packages the package never imports."""
    extras = _extras()
    text = (ROOT / "README.md").read_text()
    table = text.split("| extra | pulls | for |\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    rows = {}
    for line in table:
        name, pulls, _ = line.strip("|").split("|")
        rows[name.strip().strip("`")] = set(re.findall(r"`([\w.-]+)`", pulls))
    assert set(rows) == set(extras)
    for name, reqs in extras.items():
        if name != "dev":
            assert rows[name] == {re.split(r"[<>=!~;\[ ]", r)[0] for r in reqs}, name


def test_the_otlp_extra_is_what_the_package_imports():
    """[otlp] is grpcio alone: the OTLP writer is the package's own; opentelemetry-python's
    exporters (protobuf, requests, googleapis-common-protos) are imported nowhere in it."""
    assert [r.split(">")[0] for r in _extras()["otlp"]] == ["grpcio"]
    unused = ("opentelemetry.exporter", "opentelemetry.proto", "google", "requests")
    for f in (ROOT / "memra_obs").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad = [n for n in names if n.startswith(unused)]
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_the_readme_quotes_metrics_as_they_are_exposed():
    """Every `memra_...{labels}` the README quotes names labels its family has, a quoted sample
    line names all of them (`memra_spec_advice_info` was quoted without `family`), and every
    `le="..."` is spelt as the exposition spells the bound (`le="0"` matches nothing: it is
    `le="0.0"`, as Prometheus 3 stores it too)."""
    from prometheus_client.utils import floatToGoString

    from memra_obs.agent.main import _COUNTERS
    from memra_obs.prom.families import spec_families
    from memra_obs.tail.stats import _FAMILIES

    labels: dict[str, set[str]] = {}
    for f in spec_families(True).values():
        ends = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        for end in ends.get(f.kind, ("",)):
            labels[f.name + end] = {*f.labelnames, *(("le",) if end == "_bucket" else ())}
    for name, _, label in _FAMILIES:
        labels[f"memra_obs_tail_{name}_total"] = {"worker", *((label,) if label else ())}
    labels.update({f"{name}_total": {"worker"} for name, _ in _COUNTERS})
    text = (ROOT / "README.md").read_text()
    quotes = re.findall(r"\b(memra_\w+)\{([^}]*)\}( [\d.]+)?", text)
    assert len(quotes) > 20
    for name, inside, value in quotes:
        said = set(re.findall(r"(\w+)(?==|,|$)", inside))
        assert said <= labels[name], (name, inside)
        assert not value or labels[name] - said <= {"worker"}, (name, inside)
    for bound in re.findall(r'\ble="([^"]+)"', text):
        assert bound == floatToGoString(float(bound)), bound
