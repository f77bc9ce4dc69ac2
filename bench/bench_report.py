"""How long ``memra-obs report`` takes on a 1,000,000-line worker log, and how big the page is.

    python bench/bench_report.py [--lines N] [--keep DIR]

The log is what a worker prints at trace level 2 with the profile on (the demo's mix): per
burst of 6 rounds a phase line and its level-2 line, a ``[spec-prof-rounds]`` row per logged
round (the first 64 of a session), per session a ``[spec-prof]`` and a
``[spec-prof-summary]``; sessions of 20-120 rounds, so later bursts have no rows; and other
programs' lines in between (~3 %). Lines are formatted by :mod:`memra_obs.legacy` itself, so
they are byte-identical to a worker's. :func:`worker_log` is also the A/B tests' input
(``verify_scale`` plants a verify slowdown).

The command is timed end to end as a user runs it (a fresh process: imports, parse,
rebuild, statistics, figures, writing the page). Goal: under 60 s, page under 5 MB. The
machine's load average is printed beside the figure: the CI VM is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memra_obs.legacy import phase_lines, prof_line, prof_rounds_lines, prof_summary_line
from memra_obs.records import (
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundsLog,
    VerifySplit,
    round_prof_from_ns,
)

GOAL_S, GOAL_MB = 60.0, 5.0
OTHER = (
    "2026-12-01T10:00:{s:02d}Z INFO http: 200 POST /v1/completions {ms}ms",
    "[INFO] scheduler: batch of {ms} requests admitted",
    "WARNING: tokenizer cache miss for model revision {s}",
)


def worker_log(sessions: int, *, seed: int = 7, verify_scale: float = 1.0, other: float = 0.05):
    """The stderr lines of ``sessions`` sessions, in a worker's print order; every verify
    scaled by ``verify_scale``; a fraction ``other`` of lines from other programs."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(sessions):
        n_rounds = rng.randint(20, 120)
        alpha = min(0.95, max(0.2, rng.betavariate(7, 3)))  # per-session acceptance
        ctx = prompt = int(min(32_768, max(32, rng.lognormvariate(7.3, 0.9))))
        log = SpecRoundsLog()
        done = 0
        while done < n_rounds:
            p, rows = SpecPhaseNs(), []
            for _ in range(min(6, n_rounds - done)):
                k = 4 if rng.random() > 0.1 else rng.randint(1, 4)
                j = 0
                while j < k and rng.random() < alpha:
                    j += 1
                slow = rng.random() < 0.03
                base = 2.0 + (k + 1) * 0.12 + ctx / 40_000
                v = int(
                    base * rng.uniform(*((2.2, 3.0) if slow else (0.92, 1.12))) * verify_scale * 1e6
                )
                d, a = int(k * rng.uniform(0.18, 0.26) * 1e6), rng.randint(120_000, 160_000)
                r, m = 40_000 + 10_000 * (k - j), rng.randint(50_000, 120_000)
                p.add(SpecPhaseNs(d, v, a, r, m, 1))
                rows.append(
                    round_prof_from_ns(d + v + a + r + m, d, v, a, r + m, k, j, ctx, (k + 1) * slow)
                )
                ctx += j + 1
            split = VerifySplit(kda=p.verify * 34 // 100, kda_scan=p.verify * 14 // 100,
                                mla=p.verify * 21 // 100, ffn=p.verify * 30 // 100)  # fmt: skip
            out += phase_lines(p, "glm5-phase", "glm5-phase-v", 4, 2, split)
            if done == 0:
                out.append(prof_line(_first_token(rng, rows, prompt)))
            done += len(rows)
            for row in rows:
                log.push(row)
            fresh = log.fresh()
            out += prof_rounds_lines(fresh, log.printed - len(fresh))
            if not log.wants_more() and not log.summarized:
                log.summarized = True
                out.append(prof_summary_line(log))
            while rng.random() < other * 3:
                out.append(rng.choice(OTHER).format(s=rng.randint(0, 59), ms=rng.randint(1, 900)))
        if not log.summarized:
            out.append(prof_summary_line(log))
    return out


def _first_token(rng: random.Random, rows: list, prompt: int) -> SpecFirstTokenProf:
    r0 = rows[0]
    hook = round(rng.uniform(0.3, 0.9), 6)
    free = 79_511 - rng.randint(0, 900)
    return SpecFirstTokenProf(
        cache_alloc_ms=round(rng.uniform(0.2, 0.5), 6), prime_ms=round(2 + prompt * 0.012, 6),
        capture_ms=0.05, anchor_ms=round(rng.uniform(0.05, 0.15), 6), draft_alloc_ms=0.1,
        draft_prime_ms=round(0.3 + prompt * 0.0015, 6), first_draft_ms=r0.draft_ms,
        first_verify_ms=r0.verify_ms, first_accept_ms=r0.accept_ms, first_roll_ms=r0.rest_ms / 2,
        first_maint_ms=r0.rest_ms / 2, first_round_tokens=r0.j + 1,
        first_burst_ms=sum(r.wall_ms for r in rows) + hook + 0.3 + prompt * 0.0015,
        first_burst_hook_ms=hook, first_burst_rounds=len(rows),
        first_burst_tokens=sum(r.j + 1 for r in rows) + 1, draft_prime_rows=prompt,
        draft_prime_chunks=-(-prompt // 256), draft_prime_arm="eager", draft_kv_mb=prompt * 0.0625,
        free_mb_before=[(0, free)], free_mb_after=[(0, free - 64 - prompt // 12)],
    )  # fmt: skip


def write_log(path: Path, lines: int, seed: int = 7) -> int:
    """A log of exactly ``lines`` lines (the last session cut where the count is reached)."""
    out: list[str] = []
    while len(out) < lines:
        out += worker_log(500, seed=seed + len(out))
    path.write_text("\n".join(out[:lines]) + "\n")
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--keep", metavar="DIR", help="leave the log and the page in DIR")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        log, page = d / "worker.log", d / "report.html"
        t = time.perf_counter()
        size = write_log(log, a.lines)
        print(
            f"log: {a.lines:,} lines, {size / 1e6:.1f} MB (built in {time.perf_counter() - t:.1f} s)"
        )
        load0 = os.getloadavg()
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "memra_obs.cli", "report", str(log), "-o", str(page)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        took = time.perf_counter() - t
        load1 = os.getloadavg()
        if p.returncode != 0:
            print(p.stderr, file=sys.stderr)
            return 1
        mb = page.stat().st_size / 1e6
        print(p.stderr.strip().splitlines()[-1])
        print(f"memra-obs report: {took:.1f} s (goal < {GOAL_S:.0f} s), page {mb:.2f} MB (goal < "
              f"{GOAL_MB:.0f} MB); load average {load0[0]:.2f} before, {load1[0]:.2f} after, on "
              f"{os.cpu_count()} CPUs")  # fmt: skip
    return 0 if took < GOAL_S and mb < GOAL_MB else 1


if __name__ == "__main__":
    sys.exit(main())
