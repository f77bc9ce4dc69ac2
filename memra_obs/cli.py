"""``memra-obs``: the command line.

``demo``, ``tail``, ``agent`` and ``report`` (``memra-obs COMMAND --help``). Imports
everything; nothing imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from .device.workload import GpuUnavailable
from .environment import MEMRA_OBS_SINKS, ConfigError, positive, stop_signals
from .linewriter import stderr_writer
from .version import __version__

__all__ = ["main"]

_TAIL = (
    "Pass a worker's stderr through byte for byte and publish what its legacy lines say: "
    "/metrics on MEMRA_OBS_METRICS_ADDR, spans to MEMRA_OBS_SPANS_FILE or the OTEL_* exporter "
    "(MEMRA_OBS_SINKS, default otel,prometheus). Without --follow it ends at the input's end."
)
_REPORT = (
    "One self-contained HTML page from a worker's stderr (legacy lines) or a span file "
    "(OTLP-JSON lines), gzip'd or not; two inputs: an A/B of the runs side by side."
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memra-obs", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo",
        help="run a simulated spec-decode worker with every sink on",
        description="A simulated speculative-decoding worker, instrumented end to end: legacy "
        "lines on stderr (trace level 2 and the first-token profile unless MEMRA_SPEC_TRACE / "
        "MEMRA_SPEC_PROF say otherwise), /metrics on MEMRA_OBS_METRICS_ADDR, spans to "
        "MEMRA_OBS_SPANS_FILE or the OTEL_* exporter. Runs until Ctrl-C unless bounded.",
    )
    g = d.add_mutually_exclusive_group()
    # fmt: off
    g.add_argument("--duration", type=positive(float), metavar="SECONDS", help="stop after this long")
    g.add_argument("--requests", type=positive(int), metavar="N", help="stop after N requests")
    d.add_argument("--gpu", action="store_true", help="real kernels on the GPU (cupy or torch)")
    d.add_argument("--families", default="glm5", help="comma list of spec families (default glm5)")
    d.add_argument("--k", type=positive(int, 64), default=4,
                   help="drafted tokens per round, 1..64 (default 4)")
    d.add_argument("--concurrency", type=positive(int, 256), default=1,
                   help="loop threads, 1..256 (default 1)")
    d.add_argument("--seed", type=int, default=None, help="random seed for a repeatable run")
    d.add_argument("--speed", type=positive(float, 100, least=0.01), default=1.0,
                   help="how fast the simulated model runs: 2 = twice as fast, 0.5 = half as fast; "
                   "0.01..100 (default 1)")
    # fmt: on

    t = sub.add_parser(
        "tail", help="turn legacy stderr lines into metrics and spans", description=_TAIL
    )
    t.add_argument(
        "--follow", "-f", action="store_true", help="keep reading a growing file (follows rotation)"
    )
    t.add_argument("path", metavar="FILE|-", help="log file to read, or - for standard input")
    t.add_argument("--worker", default=None, help="worker label for what this tail publishes")
    from .tail import add_options

    add_options(t)

    r = sub.add_parser("report", help="one self-contained HTML page from a log or span file",
                       description=_REPORT)  # fmt: skip
    from .report.main import add_options as report_options

    report_options(r)

    # The agent parses its own options (memra-obs agent --help).
    sub.add_parser("agent", add_help=False, help="publish every local worker's ring (agent mode)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    if sys.stderr is None:  # started with 2>&-: notes to /dev/null on fd 2 (a file took it)
        if (fd := os.open(os.devnull, os.O_WRONLY)) != 2:  # fd 0 or 1 if closed too: not theirs
            os.dup2(fd, 2)
            os.close(fd)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    try:  # Ctrl-C while the parser imports the commands: 130, no traceback
        args, rest = _parser().parse_known_args(argv)
        if rest and args.command in ("demo", "report"):
            _parser().error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "demo":
            return _demo(args)
        if args.command == "tail":
            from .tail import main as tail_main

            return tail_main(args, rest)
        if args.command == "report":
            from .report.main import main as report_main

            return report_main(args)
        from .agent.main import main as agent_main  # "agent": argparse allows no other command

        return agent_main(rest)
    except (ConfigError, GpuUnavailable) as exc:
        print(f"memra-obs: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:  # the reader gone (`| head`): what stdout/stderr still hold goes nowhere, or
        for f in filter(None, (sys.stdout, sys.stderr)):  # the exit flush fails: 120 (None: >&-)
            try:
                f.flush()
            except BrokenPipeError:
                with contextlib.suppress(Exception):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), f.fileno())


def _demo(args: argparse.Namespace) -> int:
    from . import flags
    from .demo import DemoConfig, SimDevice, gpu_workloads, install_stop_handlers, run_demo
    from .wiring import build_observer, span_outputs

    # The demo shows everything unless the environment says otherwise (os.environ unchanged).
    env = dict(os.environ)
    if flags.MEMRA_SPEC_TRACE not in env and flags.MEMRA_GLM5_SPEC_TRACE not in env:
        env[flags.MEMRA_SPEC_TRACE] = "2"
    env.setdefault(flags.MEMRA_SPEC_PROF, "1")
    env.setdefault(MEMRA_OBS_SINKS, "all")

    cfg = DemoConfig(
        duration_s=args.duration,
        requests=args.requests,
        families=tuple(f.strip() for f in args.families.split(",") if f.strip()) or ("glm5",),
        k=args.k,
        concurrency=args.concurrency,
        seed=args.seed,
        speed=args.speed,
        gpu=args.gpu,
    )
    dev = SimDevice()
    gpus = gpu_workloads(cfg)  # no GPU: said before a banner, a bound port, a span file
    obs = build_observer(memory=None if cfg.gpu else dev.snapshot, strict=True, env=env)
    lines = obs.level or obs.prof  # (the no-op's: 0, False)
    where = list(obs.where) or [
        "publishing only the legacy lines" if lines
        else "publishing nothing (MEMRA_SPEC_TRACE, MEMRA_SPEC_PROF off; no MEMRA_OBS_SINKS on)"
    ]  # fmt: skip
    bound = "until Ctrl-C"
    if cfg.duration_s:
        bound = f"{cfg.duration_s:g}s"
    elif cfg.requests:
        bound = f"{cfg.requests} request{'s' if cfg.requests != 1 else ''}"
    kind = "GPU" if cfg.gpu else "simulated"
    _say(f"[memra-obs] demo: {kind} worker, {bound}; " + "; ".join(where))
    stop = threading.Event()
    old = install_stop_handlers(stop, stop_signals())
    try:
        stats = run_demo(cfg, obs, stop=stop, device=dev, gpus=gpus)
    finally:
        obs.shutdown(10.0)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    queue = getattr(obs, "queue", None)  # (the no-op observer's: none)
    exporters = getattr(getattr(queue, "worker", None), "exporters", ())
    _say(_done_line(stats, obs, exporters))
    # A span output that got nothing (its receiver down throughout) fails the run: status 1.
    return int(any(o.dropped and not o.exported for o in span_outputs(exporters)))


def _done_line(stats: Any, obs: Any, exporters: Sequence[Any]) -> str:
    """The demo's closing line: its counts, and what was lost or delivered where (the banner
    that said where spans go scrolled away under the lines; after shutdown: all delivered)."""
    from .wiring import delivered

    acc = stats.accepted / stats.drafted if stats.drafted else 0.0
    lost = getattr(getattr(obs, "queue", None), "dropped", 0)  # said: no /metrics is left
    spans = getattr(getattr(obs, "settings", None), "spans_file", "") or ""
    if not any(w.startswith("spans -> ") and os.path.abspath(spans) in w for w in obs.where):
        spans = ""
    return (
        f"[memra-obs] demo done: sessions={stats.sessions} rounds={stats.rounds} "
        f"tokens={stats.tokens} accept={acc:.3f} (accepted / drafted)"
        + f"; {lost} records dropped (a full queue): spans and requests lack them" * bool(lost)
        + delivered(exporters)
        + f"; spans in {spans}: memra-obs report {shlex.quote(spans)}" * bool(spans)
    )


def _say(line: str) -> None:
    stderr_writer().write_lines(
        [line], count=False
    )  # never raises (a closed pipe: `demo 2>&1 | head`)


if __name__ == "__main__":
    sys.exit(main())
