"""The README's main job end to end: `memra-obs demo` on the embedded defaults publishes
the legacy lines, /metrics and the span file; the README starts with the two commands."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from polling import wait_for

from memra_obs.legacy import FirstTokenLine, PhaseLine, VerifyLine, parse_line

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_starts_with_the_two_commands():
    """The first code block holds exactly the main job and the test suite, and both exist."""
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    cmds = [line.split("#")[0].strip() for line in block]
    assert cmds == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for c in cmds:
        assert (ROOT / c.split()[1]).is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _scripts_in(tmp_path: Path) -> None:
    """A checkout's scripts/demo.sh, scripts/_venv.sh and pyproject.toml, copied to ``tmp_path``."""
    (tmp_path / "scripts").mkdir()
    for f in ("scripts/_venv.sh", "scripts/demo.sh", "pyproject.toml"):
        (tmp_path / f).write_bytes((ROOT / f).read_bytes())


def test_the_scripts_remake_a_venv_an_older_python_made(tmp_path: Path) -> None:
    """A .venv left by a Python < 3.10 (`python3` was 3.9 on the first try) is made again, not
    reused forever with pip's "requires a different Python"; a `$PYTHON` < 3.10 is refused in
    one line before any venv or pip runs."""
    old = tmp_path / "python3.9"
    old.write_text('#!/bin/sh\n[ "$1" = -V ] && { echo "Python 3.9.18"; exit 0; }\nexit 1\n')
    old.chmod(0o755)
    _scripts_in(tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(old)
    env = {**os.environ, "PYTHON": str(old)}
    p = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 1, p.stderr
    assert ".venv has Python 3.9.18" in p.stderr and "remaking it" in p.stderr
    assert f"{old} is Python 3.9.18; the project needs Python >= 3.10" in p.stderr
    assert not (tmp_path / ".venv").exists()


def test_the_scripts_remake_a_venv_whose_making_failed(tmp_path: Path) -> None:
    """Debian's python3 without python3-venv leaves a .venv with a python and no pip: every
    later run reused it ("No module named pip"), even after python3-venv was installed."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")],
                   check=True)  # fmt: skip
    no_venv = tmp_path / "python3"  # a Python whose venv module fails, as Debian's does
    no_venv.write_text(f'#!/bin/sh\n[ "$1" = -m ] && exit 1\nexec {sys.executable} "$@"\n')
    no_venv.chmod(0o755)
    _scripts_in(tmp_path)
    env = {**os.environ, "PYTHON": str(no_venv)}
    p = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 1, p.stderr
    assert "[venv] .venv has no pip (its making failed): remaking it" in p.stderr
    assert "-m venv failed (Debian: apt-get install python3-venv)" in p.stderr
    assert not (tmp_path / ".venv").exists()  # the next run makes it whole


def test_the_scripts_first_install_shows_no_setuptools_editable_note(tmp_path: Path) -> None:
    """A fresh clone's first `scripts/demo.sh` printed setuptools' 10-line "Editable
    installation ... be careful with folders in your working directory" note (pip re-emits a
    build backend's warnings); it is filtered where pip's build runs, and any other warning of
    that build, a user's own filter too, still shows."""
    _scripts_in(tmp_path)
    build = tmp_path / "build.py"  # setuptools' build in pip's subprocess: inherited filters
    build.write_text(
        "import warnings\n"
        "warnings.warn('Editable installation.\\n!!\\nPlease be careful', UserWarning)\n"
        "warnings.warn('Retrying after connection broken', UserWarning)\n"
        "warnings.warn('a filter of the user', UserWarning)\n"
    )
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(  # pip: --version works, an install (-e) runs the build
        f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then
  case "$*" in *" -e "*) exec {sys.executable} {build};; esac
  exit 0
fi
exec {sys.executable} "$@"
"""
    )
    (venv_bin / "python").chmod(0o755)
    env = {**os.environ, "PYTHONWARNINGS": "ignore:a filter of the user", "EXTRAS": ""}
    p = subprocess.run(["bash", "-c", "source scripts/_venv.sh"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "Editable installation" not in p.stderr and "careful" not in p.stderr
    assert "Retrying after connection broken" in p.stderr
    assert "a filter of the user" not in p.stderr
    assert (tmp_path / ".venv" / ".memra-obs-installed-core").is_file()


def test_demo_publishes_lines_metrics_and_spans(tmp_path):
    """Embedded defaults: stderr lines that parse, /metrics with exemplars, OTLP-JSON spans."""
    import signal

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env["MEMRA_OBS_METRICS_ADDR"] = f"127.0.0.1:{port}"
    # Run for as long as the scrape needs (a fixed --duration 6 was all the time a busy host's
    # scrape had to find rounds), then end it with Ctrl-C: the demo's own stop, status 0.
    proc = subprocess.Popen(
        [sys.executable, "-m", "memra_obs.cli", "demo", "--duration", "60", "--seed", "3"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def scraped() -> str:  # the exposition once it has rounds, else "" (not yet)
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/metrics",
                headers={"Accept": "application/openmetrics-text; version=1.0.0"},
            )
            body = urllib.request.urlopen(req, timeout=5).read().decode()
            return body if "memra_spec_rounds_total{" in body else ""

        body = wait_for("rounds on the demo's /metrics", scraped, 40.0, 0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert 'memra_spec_rounds_total{family="glm5"}' in body
    assert "# {" in body and "trace_id=" in body, "exemplars in the OpenMetrics exposition"
    kinds = {type(parse_line(line)).__name__ for line in err.splitlines() if line.startswith("[")
             and not line.startswith("[memra-obs]")}  # fmt: skip
    assert {PhaseLine.__name__, VerifyLine.__name__, FirstTokenLine.__name__} <= kinds
    assert "[memra-obs] demo done: sessions=" in err
    # the banner scrolled away under the lines: the closing line says where the spans went
    done = next(x for x in err.splitlines() if "demo done:" in x)
    assert done.endswith("; spans in memra-obs-spans.jsonl: memra-obs report memra-obs-spans.jsonl")
    spans = (tmp_path / "memra-obs-spans.jsonl").read_text().splitlines()
    assert spans
    # and how many got there (a Jaeger user could not tell a short trace list from lost spans)
    written = sum(len(ss["spans"]) for line in spans for rs in json.loads(line)["resourceSpans"]
                  for ss in rs["scopeSpans"])  # fmt: skip
    assert f"; spans to file: {written} exported, 0 dropped; spans in" in done, done
    names = {
        s["name"]
        for line in spans
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    }
    assert {"spec.session", "spec.burst", "spec.round", "spec.verify", "spec.first_token"} <= names


def _no_gpu_libraries(tmp_path: Path) -> dict[str, str]:
    """An environment whose cupy and torch fail to import, as on a host without them."""
    for name in ("cupy", "torch"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), MEMRA_OBS_SINKS="")
    return env


def test_demo_gpu_without_a_gpu_fails_before_any_loop(monkeypatch) -> None:
    """Issue 13: with no CuPy or torch, run_demo(gpu=True) raises GpuUnavailable (one line) in
    the caller's thread before any loop starts (main: each loop thread died with a traceback
    and the run reported 0 sessions)."""
    import threading

    from memra_obs.demo import DemoConfig, GpuUnavailable, run_demo
    from memra_obs.testing import capture

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    before = threading.active_count()
    with capture(level=0) as cap, pytest.raises(GpuUnavailable) as e:
        run_demo(DemoConfig(requests=1, gpu=True, concurrency=2), cap.observer)
    assert str(e.value).count("\n") == 0 and "cupy is not installed" in str(e.value)
    assert "pip install 'memra_obs[cuda12]'" in str(e.value)  # what to do: the extra that has them
    assert threading.active_count() == before


def test_demo_gpu_without_a_gpu_exits_2_with_one_line(tmp_path: Path) -> None:
    """Issue 13: `memra-obs demo --gpu` without a GPU exits 2 with one line, no traceback
    (main: a thread traceback and exit 0)."""
    p = subprocess.run(
        [sys.executable, "-m", "memra_obs.cli", "demo", "--gpu", "--requests", "1"],
        cwd=tmp_path, env=_no_gpu_libraries(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.splitlines()[-1].startswith("memra-obs: --gpu needs a CUDA device")
    # Said before anything starts: no banner claiming a running demo, no span file left behind
    # (/metrics was bound and an empty span file created before the refusal).
    assert p.stderr.splitlines() == [p.stderr.splitlines()[-1]], p.stderr
    assert list(tmp_path.glob("*.jsonl")) == []


def test_demo_in_process_leaves_handlers_and_environment_and_scales_the_split(
    tmp_path, monkeypatch, capfd
) -> None:
    """``cli.main(["demo", ...])`` from Python restores SIGINT/SIGTERM and leaves os.environ as
    it was (it kept the demo's handlers and MEMRA_SPEC_TRACE=2 ...); with ``--speed`` the
    level-2 split is of the scaled verify (vkda + vmla fit inside verify)."""
    import signal

    from memra_obs.cli import main

    monkeypatch.chdir(tmp_path)
    for var in ("MEMRA_SPEC_TRACE", "MEMRA_GLM5_SPEC_TRACE", "MEMRA_SPEC_PROF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MEMRA_OBS_SINKS", "")
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), dict(os.environ))
    assert main(["demo", "--requests", "2", "--speed", "4", "--seed", "1"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before[:2]
    assert dict(os.environ) == before[2]
    lines = [parse_line(x) for x in capfd.readouterr().err.splitlines() if "-phase" in x]
    phases = [x for x in lines if isinstance(x, PhaseLine)]
    splits = [x for x in lines if isinstance(x, VerifyLine)]
    assert phases and len(splits) == len(phases)
    for p, v in zip(phases, splits, strict=True):
        assert v.vkda_ms + v.vmla_ms <= p.per_verify_ms * 1.01 + 0.002


def test_demo_done_says_the_records_its_full_queue_dropped(tmp_path, monkeypatch, capfd) -> None:
    """A demo that outruns its exporter (``--concurrency 8 --speed 100`` on two busy cores: its
    span and requests files held 1,213 of 3,996 sessions) says on its last line how many records
    its queue dropped: no /metrics is left to count them once it has ended."""
    from memra_obs.cli import main

    monkeypatch.chdir(tmp_path)
    for var, value in (("MEMRA_OBS_QUEUE_SIZE", "16"), ("MEMRA_OBS_EXPORT_INTERVAL_MS", "60000"),
                       ("MEMRA_OBS_SINKS", "otel"), ("MEMRA_OBS_METRICS_ADDR", "")):  # fmt: skip
        monkeypatch.setenv(var, value)
    assert main(["demo", "--requests", "3", "--speed", "100", "--seed", "1"]) == 0
    done = [x for x in capfd.readouterr().err.splitlines() if "demo done:" in x]
    assert len(done) == 1 and re.search(r"; [1-9]\d* records dropped \(a full queue\)", done[0])


def test_demo_with_everything_off_says_it_publishes_nothing(tmp_path, monkeypatch, capfd):
    """The flags off and no sink: the banner said "publishing only the legacy lines", and
    none came."""
    from memra_obs.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMRA_OBS_SINKS", "")
    monkeypatch.setenv("MEMRA_SPEC_PROF", "0")
    for trace, said in (("0", "publishing nothing"), ("1", "publishing only the legacy lines")):
        monkeypatch.setenv("MEMRA_SPEC_TRACE", trace)
        assert main(["demo", "--requests", "2", "--speed", "100", "--seed", "1"]) == 0
        err = capfd.readouterr().err
        assert said in err.splitlines()[0] and ("[glm5-phase]" in err) == (trace == "1")


def _demo(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SINKS="otel")
    return subprocess.Popen([sys.executable, "-m", "memra_obs.cli", "demo", "--seed", "1", *args],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_the_closing_line_names_a_span_file_only_where_one_was_written(tmp_path):
    """Spans sent elsewhere (``OTEL_TRACES_EXPORTER=none``, an OTLP endpoint) wrote no file:
    the closing line pointed the report at one all the same."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SINKS="otel", OTEL_TRACES_EXPORTER="none")
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--seed", "1", "--requests",
                        "1", "--speed", "20"], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                       text=True, timeout=60)  # fmt: skip
    done = next(x for x in p.stderr.splitlines() if "demo done:" in x)
    assert p.returncode == 0 and "spans in" not in done, done
    assert not (tmp_path / "memra-obs-spans.jsonl").exists()


def test_the_closing_line_counts_each_outputs_spans(tmp_path):
    """Two span outputs (``OTEL_TRACES_EXPORTER=file,console``): the closing line said each span
    twice (2,214 exported beside a file of 1,107); each output is counted on its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SINKS="otel", MEMRA_OBS_SPANS_FILE="a.jsonl",
               OTEL_TRACES_EXPORTER="file,console")  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--seed", "3", "--requests",
                        "2", "--speed", "20"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    done = next(x for x in p.stderr.splitlines() if "demo done:" in x)
    written = sum(len(ss["spans"]) for line in (tmp_path / "a.jsonl").read_text().splitlines()
                  for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"])  # fmt: skip
    assert f"; spans to file: {written} exported, 0 dropped; " in done, done
    assert f"; spans to console: {written} exported, 0 dropped; " in done, done


def test_a_demo_whose_spans_all_dropped_ends_1(tmp_path):
    """A receiver down for the whole run (no collector on the endpoint): the closing line said
    ``0 exported, N dropped`` and the demo ended 0, a smoke check that passed with nothing
    delivered. Status 1 now; a span output that got its spans still ends 0 (the file, here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SINKS="otel", OTEL_TRACES_EXPORTER="otlp",
               OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1", OTEL_EXPORTER_OTLP_TIMEOUT="300")  # fmt: skip
    for exporter, status in (("otlp", 1), ("file", 0)):
        env["OTEL_TRACES_EXPORTER"] = exporter
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--seed", "1",
                            "--requests", "1", "--speed", "20"], cwd=tmp_path, env=env,
                           stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
        done = next(x for x in p.stderr.splitlines() if "demo done:" in x)
        assert p.returncode == status, p.stderr
        assert re.search(r"; spans to \w+: 0 exported, [1-9]" if status else " 0 dropped", done)


def test_demo_arguments_are_bounded_and_its_stops_are_kept(tmp_path):
    """``--k 100000`` (refused by the loop: a demo that recorded nothing and could not be
    stopped) is a usage error, as is junk; ``--duration`` ends the request in flight after its
    burst (``--speed 0.02 --duration 1`` ran 6+ s); a second SIGTERM ends it at once."""
    import signal

    for bad, says in (
        ("--k=100000", "positive integer up to 64"),
        ("--speed=abc", "number from 0.01 to 100"),
        ("--speed=0.001", "number from 0.01 to 100"),
        ("--duration=inf", "positive number"),  # it ran for ever, as "infs"
        ("--k=١٢", "positive integer"),  # int() reads other scripts' digits
        ("--requests=1_0", "positive integer"),
    ):
        p = _demo(tmp_path, bad)
        err = p.communicate(timeout=60)[1]
        assert p.returncode == 2 and f"argument {bad.split('=')[0]}: " in err and says in err
    p = _demo(tmp_path, "--speed", "0.02", "--duration", "1")
    assert p.stderr is not None and "[memra-obs] demo:" in p.stderr.readline()
    t0 = time.monotonic()  # the loop starts at the banner: the interpreter's start-up not counted
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 0 and "demo done: sessions=1 " in err, err
    # Seed 1 at this speed: the session's set-up (its prime) alone is ~1.8 s of simulated
    # sleeps, the deadline passes in it and the demo ends there (~1.9 s in all); the request run
    # on past the deadline is 61 rounds, ~14 s (the defect's "6+ s" counted start-up too).
    assert time.monotonic() - t0 < 4
    p = _demo(tmp_path, "--speed", "0.01")
    assert p.stderr is not None and "[memra-obs] demo:" in p.stderr.readline()
    # Seed 1 at --speed 0.01: the session's set-up takes >= 3.6 s of simulated device time (its
    # prime). Both signals land in it; the first only stops the loop after it, so a second one
    # that did not end the demo at once (handled only once the loop is done, or ignored) takes
    # >= ~3 s more, or ends it with status 0.
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGTERM and time.monotonic() - t0 < 1.5


def test_speed_is_how_fast_the_simulated_model_runs():
    """``--speed 4``: four times as fast (it multiplied the simulated times, so 4 ran slower)."""
    import random
    import types

    from memra_obs.demo import SimDevice, SimWorkload

    w = SimWorkload(random.Random(1), SimDevice(), speed=4)
    queued: list[float] = []
    w.stream = types.SimpleNamespace(enqueue=queued.append)
    w._dev(8.0)
    assert queued == [0.002]


def test_version_and_python_dash_m() -> None:
    """``memra-obs --version`` says the package's version (the metadata's too), and
    ``python -m memra_obs`` is the same command where the script is not on PATH."""
    from importlib.metadata import version

    from memra_obs import __version__

    out = subprocess.run([sys.executable, "-m", "memra_obs", "--version"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout == f"memra-obs {__version__}\n"
    assert version("memra_obs") == __version__


def test_demo_piped_to_head_exits_0(tmp_path: Path) -> None:
    """``memra-obs demo --requests N 2>&1 | head``: the reader gone, the demo still ends 0 (its
    closing line raised BrokenPipeError: a traceback and status 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SINKS="")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--requests", "2", "--speed", "50"],
                       cwd=tmp_path, env=env, stderr=w, timeout=60)  # fmt: skip
    os.close(w)
    assert p.returncode == 0


def test_ctrl_c_while_the_parser_imports_the_commands_is_130() -> None:
    """Ctrl-C in the first fraction of a second (the parser imports every command's options):
    status 130 and no traceback, as later (it was a KeyboardInterrupt traceback)."""
    code = (
        "from memra_obs import cli\n"
        "def interrupted():\n    raise KeyboardInterrupt\n"
        "cli._parser = interrupted\nraise SystemExit(cli.main(['tail', '-']))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (130, ""), p.stderr
