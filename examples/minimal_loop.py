"""The README's "Instrumenting a loop", runnable: a spec-decode loop whose model is sleeps.

    MEMRA_SPEC_TRACE=1 MEMRA_SPEC_PROF=1 python examples/minimal_loop.py

prints the ``[glm5-phase]`` lines, the ``[spec-prof]`` first-token profile and the round log on
stderr; add ``MEMRA_OBS_SINKS=otel MEMRA_OBS_SPANS_FILE=spans.jsonl`` for spans, then
``memra-obs report spans.jsonl``. Replace each ``work(ms)`` with your loop's own step.
"""

from __future__ import annotations

import random
import sys
import time

import memra_obs


def work(ms: float) -> None:
    time.sleep(ms / 1e3)


def main(requests: int = 3, k: int = 4, rounds_per_burst: int = 6, tokens: int = 64) -> None:
    obs = memra_obs.get_observer()  # no-op unless a flag, MEMRA_OBS_SINKS or _REQUESTS_FILE
    rng = random.Random(0)
    for _ in range(requests):
        with obs.session("glm5", e=None, eh=None) as s:  # e/eh: your CuPy or torch streams
            s.free_memory("before")
            work(1.0)
            s.lap("cache_alloc")
            work(5.0)
            s.lap("prime")
            work(0.2)
            s.lap("anchor")
            work(1.0)
            s.lap("draft_alloc")
            s.free_memory("after")
            done = 0
            while done < tokens:
                b = s.burst(k=k)
                for _ in range(rounds_per_burst):
                    b.begin_round()
                    work(0.5)
                    b.end_draft()
                    work(2.0)
                    b.end_verify()
                    j = rng.randint(0, k)  # drafts accepted: the round commits j + 1 tokens
                    work(0.1)
                    b.end_accept()
                    work(0.05)
                    b.end_rollback()
                    work(0.05)
                    b.end_round(k=k, j=j, ctx=2000 + done)
                    done += j + 1
                    with b.hook():  # the commit hook (detokenize, send): first_burst_hook_ms
                        work(0.05)
                b.end()
    obs.flush()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
