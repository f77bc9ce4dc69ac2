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


def test_every_knob_has_its_readme_row_and_its_configure_argument():
    """A knob is three places a user reads: its variable in the README's Knobs table, its
    ``configure()`` argument ("Every knob also has a constructor argument"), its Settings
    field; one left out was found by no test."""
    import dataclasses
    import inspect

    import memra_obs
    from memra_obs.environment import _TABLE, Settings

    text = (ROOT / "README.md").read_text().split("\n## Knobs\n", 1)[1]
    table = text[text.index("\n|") : text.index("\n\n", text.index("\n|"))]
    rows = {v for line in table.splitlines() for v in re.findall(r"`(MEMRA_OBS_\w+)`",
                                                                    line.split(" | ")[0])}  # fmt: skip
    assert rows == {var for _, var, _ in _TABLE}
    fields = {f.name for f in dataclasses.fields(Settings) if f.compare}
    assert fields == {name for name, _, _ in _TABLE}
    assert fields <= set(inspect.signature(memra_obs.configure).parameters)


def test_every_metric_has_its_readme_row():
    """Metric names are public interface (DESIGN §5): each family the loop, the agent or the
    tail exposes is a row of a README metrics table (the agent's counters: named in its
    section), with its exposed name."""
    from memra_obs.agent.main import _COUNTERS
    from memra_obs.prom.families import spec_families
    from memra_obs.tail.stats import _FAMILIES

    text = (ROOT / "README.md").read_text()
    rows = set(re.findall(r"^\| `(memra_\w+)`", text, re.M))
    exposed = {f.name + "_total" * (f.kind == "counter") for f in spec_families(True).values()}
    exposed |= {f"memra_obs_tail_{name}_total" for name, _, _ in _FAMILIES}
    assert exposed <= rows, sorted(exposed - rows)
    for name, _ in _COUNTERS:
        assert f"`{name}_total" in text, name


def test_the_design_contract_is_in_the_repository():
    """Code, tests and docs cite "DESIGN §N": docs/DESIGN.md is the contract (and the seed it
    names, docs/seeds/), each cited section exists, and where the developers' shared copy is
    beside the clone the two are one text."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, re.M))
    for f in ("spec_phase.rs", "spec_phase.module-doc.txt", "SpecFirstTokenProf.struct-doc.txt"):
        assert (ROOT / "docs" / "seeds" / f).is_file(), f
    cited = set()
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("memra_obs/**/*.py"),
                 *ROOT.glob("tests/*.py")]:  # fmt: skip
        cited |= set(re.findall(r"DESIGN §(\d+)", path.read_text()))
    assert cited and cited <= sections, sorted(cited - sections)
    shared = ROOT.parent / "shared" / "DESIGN.md"
    if shared.is_file():
        assert shared.read_text() == design, "docs/DESIGN.md is behind ../shared/DESIGN.md"
