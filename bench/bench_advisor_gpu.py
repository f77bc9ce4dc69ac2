"""The k advisor against measured throughput, on a real transformer spec loop. On one GPU:

    python bench/bench_advisor_gpu.py              # torch; random weights, no downloads
    python bench/bench_advisor_gpu.py --dry-run    # the same logic on a sleep-timed fake (CPU)

Target: GPT-2 shapes (n_embd 1024, 16 heads, GPT-2 medium's width) with 24 layers; drafter: the
same width, 2 layers; fp16, greedy, written in plain torch with a preallocated KV cache cropped
on rollback (Hugging Face's GPT-2 took ~0.1 s a round in Python on the H200: its overhead, not
the GPU, would have been what the advisor priced). Random
weights make argmax acceptance meaningless, so acceptance is *planted*: ``j`` is drawn from a
known per-position curve (``--curve``, fixed seed; the same uniforms for every k, so the sweep
compares k on common random numbers). The compute is real: k sequential drafter steps, one
verify forward over k+1 rows, the argmax readback, the target cache cropped to the accepted
prefix, the drafter's cache cropped in maintenance.

1. short run at one k (``--k``; 10% of rounds draft fewer, a confidence gate as in the demo),
   instrumented with the event clock (``memra_obs.configure(clock="event")``, the torch stream
   passed as ``e``), rounds collected by ``RecordingSink`` -> ``advise()``; again with the gate
   off (k constant: the fallback the cost model flags);
2. sweep k = 1..``--sweep-max``: measured tokens/s (wall clock, drained, no instrument);
3. a plain one-token-per-step greedy loop on the target: measured tokens/s.

The sweep and the plain loop run in short blocks (``--sweep-rounds`` each), every k once per
repetition in rotated order, until ``--repeats`` or the budget: a launch-bound loop's speed drifts
with the shared host by tens of percent over seconds, and fine interleaving gives every k the same
drift. A k's figure pools its blocks (tokens / seconds); repetition r plants uniforms from seed
``seed + r`` for every k alike (common random numbers, new ones each repetition).

Prints a table and one JSON document (also to ``$OUT/advisor.json`` when OUT is set): measured
tok/s per k, the best k, the advisor's k and its measured tok/s (goal: >= 0.95 of the best),
estimated vs measured speedup over the plain loop. Budget: well under 5 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memra_obs
from memra_obs.analysis import Advice, advise
from memra_obs.testing import RecordingSink

CURVES: dict[str, list[float]] = {
    "flat": [0.75] * 32,
    "decaying": [0.92 * 0.9**i for i in range(32)],
    "cliff": [0.9 if i < 3 else 0.2 for i in range(32)],
}
K_DRAWS = 32  # uniforms drawn per round whatever k is: round n sees the same ones at every k


class Planted:
    """j from a known per-position curve: accept draft i while u_i < alpha_i."""

    def __init__(self, curve: list[float], seed: int) -> None:
        self.curve, self.seed = curve, seed
        self.rng = random.Random(seed)

    def restart(self, rep: int = 0) -> None:
        self.rng = random.Random(self.seed + rep)

    def draw(self, k: int) -> int:
        u = [self.rng.random() for _ in range(K_DRAWS)]
        j = 0
        while j < k and u[j] < self.curve[j]:
            j += 1
        return j


class FakeLoop:
    """--dry-run: the loop's phases as host sleeps (no device, host clock), same interface."""

    clock = "host"

    def __init__(self, plant: Planted) -> None:
        self.plant, self.e, self.length = plant, None, 0

    def describe(self) -> str:
        return "dry run: sleep-timed fake loop (no device)"

    def reset(self) -> None:
        self.length = 0

    def full(self) -> bool:
        return self.length >= 400

    def sync(self) -> None:
        pass

    def draft(self, k: int) -> None:
        time.sleep(k * 0.00025)

    def verify(self, k: int) -> None:
        time.sleep(0.0012 + 0.00004 * (k + 1))

    def accept(self, k: int) -> int:
        time.sleep(0.0001)
        return self.plant.draw(k)

    def rollback(self, k: int, j: int) -> None:
        self.length += j + 1

    def maint(self) -> None:
        pass

    def plain_step(self) -> None:
        time.sleep(0.00124)
        self.length += 1


class _Gpt:
    """A GPT-2-shaped decoder in plain torch (pre-LN blocks, fused QKV, GELU MLP, tied
    embeddings) with a preallocated KV cache: ``crop(n)`` keeps the first n positions, as a
    serving engine's paged cache does. Random fp16 weights; no framework overhead between
    kernels beyond torch's own."""

    def __init__(self, t: Any, dev: Any, layers: int, maxlen: int, d: int = 1024, heads: int = 16,
                 vocab: int = 50257) -> None:  # fmt: skip
        self.t, self.F, self.d, self.h = t, t.nn.functional, d, heads

        def w(*shape: int, std: float = 0.02) -> Any:
            return (t.randn(*shape, device=dev) * std).half()

        self.wte, self.wpe = w(vocab, d), w(maxlen, d, std=0.01)
        ones, zeros = (
            (lambda: t.ones(d, device=dev).half()),
            (lambda: t.zeros(d, device=dev).half()),
        )
        self.blocks = [
            (ones(), zeros(), w(d, 3 * d), zeros().repeat(3), w(d, d), zeros(),
             ones(), zeros(), w(d, 4 * d), zeros().repeat(4), w(4 * d, d), zeros())
            for _ in range(layers)
        ]  # fmt: skip
        self.lnf = (ones(), zeros())
        shape = (layers, 1, heads, maxlen, d // heads)
        self.K = t.zeros(shape, device=dev, dtype=t.float16)
        self.V = t.zeros(shape, device=dev, dtype=t.float16)
        self.len = 0

    def __call__(self, ids: Any) -> Any:
        """Logits [1, T, vocab] for ``ids`` [1, T] appended at the cache's end."""
        t, F, d, h = self.t, self.F, self.d, self.h
        T, n = ids.shape[1], self.len
        x = self.wte[ids] + self.wpe[n : n + T]
        mask = None if T == 1 else t.ones(T, n + T, device=ids.device, dtype=t.bool).tril(n)
        for i, (g1, b1, wqkv, bqkv, wo, bo, g2, b2, wfc, bfc, wp, bp) in enumerate(self.blocks):
            a = F.layer_norm(x, (d,), g1, b1)
            q, k, v = (a @ wqkv + bqkv).view(1, T, 3, h, d // h).permute(2, 0, 3, 1, 4)
            self.K[i, :, :, n : n + T] = k
            self.V[i, :, :, n : n + T] = v
            o = F.scaled_dot_product_attention(
                q, self.K[i, :, :, : n + T], self.V[i, :, :, : n + T], attn_mask=mask
            )
            x = x + o.transpose(1, 2).reshape(1, T, d) @ wo + bo
            m = F.layer_norm(x, (d,), g2, b2)
            x = x + F.gelu(m @ wfc + bfc, approximate="tanh") @ wp + bp
        self.len = n + T
        return F.layer_norm(x, (d,), *self.lnf) @ self.wte.T

    def crop(self, n: int) -> None:
        self.len = min(self.len, n)


class GptLoop:
    """The real loop: GPT-2-shaped target (24 layers) and drafter (2 layers) on one GPU."""

    clock = "event"

    def __init__(self, plant: Planted, prompt: int, new_tokens: int, seed: int) -> None:
        import torch

        self.t = torch
        self.plant, self.prompt, self.cap = plant, prompt, prompt + new_tokens
        self.dev = torch.device("cuda", 0)
        torch.manual_seed(seed)
        torch.set_grad_enabled(False)
        # cuDNN's attention builds a plan for each new shape, and a decode loop's length changes
        # every step: that planning, not the model, would be what the advisor priced.
        torch.backends.cuda.enable_cudnn_sdp(False)
        maxlen = self.cap + 64
        self.target = _Gpt(torch, self.dev, 24, maxlen)
        self.drafter = _Gpt(torch, self.dev, 2, maxlen)
        self.e = torch.cuda.current_stream(self.dev)
        self.vocab = self.target.wte.shape[0]
        self.reset()

    def describe(self) -> str:
        t = self.t
        name = t.cuda.get_device_name(self.dev)
        return f"{name}, torch {t.__version__} (CUDA {t.version.cuda}); GPT-2 shapes in plain torch"

    def reset(self) -> None:
        t = self.t
        p = t.randint(0, self.vocab, (1, self.prompt), device=self.dev)
        self.target.crop(0)
        self.drafter.crop(0)
        self.target(p[:, :-1])
        self.drafter(p[:, :-1])
        self.seq = p  # committed tokens; each cache holds all but the last
        self.e.synchronize()

    def full(self) -> bool:
        return self.seq.shape[1] >= self.cap

    def sync(self) -> None:
        self.e.synchronize()

    def draft(self, k: int) -> None:
        inp, toks = self.seq[:, self.drafter.len :], []
        for _ in range(k):
            inp = self.drafter(inp)[:, -1:].argmax(-1)  # stays on the device: the next input
            toks.append(inp)
        self.drafts = self.t.cat(toks, dim=1) if toks else self.seq[:, :0]

    def verify(self, k: int) -> None:
        rows = self.t.cat([self.seq[:, -1:], self.drafts], dim=1)  # k+1 rows, one forward
        self.logits = self.target(rows)

    def accept(self, k: int) -> int:
        ids = self.logits[0].argmax(-1)
        ids.tolist()  # the accept walk's device->host readback (a real loop compares here)
        j = self.plant.draw(k)
        self.bonus = ids[j : j + 1].view(1, 1)
        return j

    def rollback(self, k: int, j: int) -> None:
        n = self.seq.shape[1]
        self.seq = self.t.cat([self.seq, self.drafts[:, :j], self.bonus], dim=1)
        self.target.crop(n + j)  # keep the accepted prefix; the bonus token is fed next round

    def maint(self) -> None:
        n = self.seq.shape[1] - 1
        if self.drafter.len > n:
            self.drafter.crop(n)

    def plain_step(self) -> None:
        nxt = self.target(self.seq[:, -1:])[:, -1:].argmax(-1)
        nxt.item()  # a streaming server reads every token back
        self.seq = self.t.cat([self.seq, nxt], dim=1)


def spec_round(w: Any, k: int) -> int:
    w.draft(k)
    w.verify(k)
    j = w.accept(k)
    w.rollback(k, j)
    w.maint()
    return j


def short_run(w: Any, k: int, rounds: int, gate: float, seed: int) -> list[Any]:
    """``rounds`` instrumented rounds at k (a share ``gate`` drafting fewer) -> RoundRecords."""
    sink = RecordingSink()
    obs = memra_obs.configure(
        level=0,
        prof=False,
        sinks="",
        extra_sinks=[sink],
        clock="sync" if w.e is None else "event",
        env={},
    )
    rng, done = random.Random(seed), 0
    w.plant.restart()
    while done < rounds:
        w.reset()
        with obs.session("bench", e=w.e) as s:
            while done < rounds and not w.full():
                b = s.burst(k)
                for _ in range(min(8, rounds - done)):
                    kk = k if rng.random() >= gate else rng.randint(1, k)
                    b.begin_round()
                    w.draft(kk)
                    b.end_draft()
                    w.verify(kk)
                    b.end_verify()
                    j = w.accept(kk)
                    b.end_accept()
                    w.rollback(kk, j)
                    b.end_rollback()
                    w.maint()
                    b.end_round(k=kk, j=j)
                    done += 1
                b.end()
    obs.shutdown()
    return [r for r in sink.records if hasattr(r, "phase_ns")]


def measure(w: Any, k: int, rounds: int, rep: int = 0) -> tuple[int, float]:
    """(tokens, seconds) of ``rounds`` uninstrumented rounds at k (k = 0: plain steps), wall
    clock from drained start to drained end, session resets left out; ``rep``: the uniforms."""
    tokens = elapsed = done = 0
    w.plant.restart(rep)
    while done < rounds:
        w.reset()
        t0 = time.perf_counter()
        while done < rounds and not w.full():
            if k:
                tokens += spec_round(w, k) + 1
            else:
                w.plain_step()
                tokens += 1
            done += 1
        w.sync()
        elapsed += time.perf_counter() - t0
    return tokens, elapsed


def summary(a: Advice | None) -> dict[str, Any] | None:
    if a is None:
        return None
    c = a.costs
    return {
        "estimate": a.estimate,
        "clock": a.clock,
        "rounds": a.rounds,
        "recommended_k": a.recommended_k,
        "expected_tokens": list(a.expected_tokens),
        "tokens_per_s": list(a.tokens_per_s),
        "estimated_speedup": list(a.estimated_speedup),
        "plain_step_ms": a.plain_step_ns / 1e6,
        "plain_step_source": a.plain_step_source,
        "current_k": a.current_k,
        "measured_tokens_per_s": a.measured_tokens_per_s,
        "identifiable": c.identifiable,
        "assumption": c.assumption,
        "costs_ms": {
            "draft_fixed": c.draft_fixed_ns.value / 1e6,
            "draft_per_token": c.draft_per_token_ns.value / 1e6,
            "verify_fixed": c.verify_fixed_ns.value / 1e6,
            "verify_per_row": c.verify_per_row_ns.value / 1e6,
            "accept": c.accept_ns.value / 1e6,
            "rollback": c.rollback_ns.value / 1e6,
            "maint": c.maint_ns.value / 1e6,
        },
        "alpha": [list(p.alpha) for p in a.acceptance.positions],
        "curve": [{"k": p.k, "tokens_per_s": list(p.tokens_per_s)} for p in a.curve],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU fake loop, small sizes")
    ap.add_argument("--curve", choices=sorted(CURVES), default="decaying")
    ap.add_argument(
        "--k", type=int, nargs="+", default=[8, 2], help="short-run k's (the first is the headline)"
    )
    ap.add_argument("--short-rounds", type=int, default=None)
    ap.add_argument("--sweep-max", type=int, default=None)
    ap.add_argument("--sweep-rounds", type=int, default=None, help="rounds a k runs per repetition")
    ap.add_argument("--repeats", type=int, default=None, help="sweep repetitions (pooled)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new repetition past this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=768, help="tokens per session before a reset")
    args = ap.parse_args(argv)
    dry = args.dry_run
    short_n = args.short_rounds or (160 if dry else 600)
    kmax = args.sweep_max or (8 if dry else 12)
    sweep_n = args.sweep_rounds or (50 if dry else 60)
    repeats = args.repeats or (1 if dry else 40)
    if max(args.k) > kmax:
        ap.error(f"--k {max(args.k)} is past --sweep-max {kmax}")
    t_start = time.perf_counter()
    plant = Planted(CURVES[args.curve], args.seed)
    w: Any = FakeLoop(plant) if dry else GptLoop(plant, args.prompt, args.new_tokens, args.seed)
    print(f"# {w.describe()}; curve {args.curve}; clock {w.clock}", flush=True)
    tok, sec = measure(w, args.k[0], 5 if dry else 200)  # warm-up: kernels, allocator, clocks
    measure(w, 0, 5 if dry else 100)
    print(
        f"# warm-up at {time.perf_counter() - t_start:.0f} s: k={args.k[0]} {tok / sec:.0f} tok/s"
    )

    # 1. short runs at one k each (10% of rounds gated shorter), and the headline k ungated
    recs = {k: short_run(w, k, short_n, 0.1, args.seed) for k in args.k}
    advice = {k: advise(r, max_k=kmax, clock=w.clock) for k, r in recs.items()}
    k0 = args.k[0]
    const = advise(short_run(w, k0, short_n, 0.0, args.seed), max_k=kmax, clock=w.clock)
    print(f"# short runs done at {time.perf_counter() - t_start:.0f} s", flush=True)

    # 2. + 3. the sweep and the plain loop (k = 0): short blocks, every k once a repetition in
    # rotated order, pooled (the host's drift is shared alike; the module docstring says why)
    blocks: dict[int, list[tuple[int, float]]] = {k: [] for k in range(0, kmax + 1)}
    order, done = list(range(0, kmax + 1)), 0
    for rep in range(repeats):
        t_rep = time.perf_counter()
        for k in order[rep % len(order) :] + order[: rep % len(order)]:
            blocks[k].append(measure(w, k, sweep_n, rep))
        done += 1
        now = time.perf_counter()
        if done % 10 == 0 or done == repeats:
            print(f"# sweep repetition {done} done at {now - t_start:.0f} s", flush=True)
        if now - t_start + (now - t_rep) > args.budget_s:
            break
    measured = {k: sum(t for t, _ in b) / sum(s for _, s in b) for k, b in blocks.items()}
    tpr = {k: sum(t for t, _ in b) / (sweep_n * len(b)) for k, b in blocks.items()}
    plain = measured.pop(0)
    best_k = max(measured, key=lambda k: measured[k])

    def rates(k: int) -> list[float]:
        return [t / s for t, s in blocks[k]]

    def paired(k: int) -> tuple[float, float, float]:
        """k's tok/s over the best k's, repetition by repetition: median and quartiles."""
        r = [a / b for a, b in zip(rates(k), rates(best_k), strict=True)]
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        return q[1], q[0], q[2]

    with_plain = advise(recs[k0], max_k=kmax, clock=w.clock, plain_step_ns=1e9 / plain)

    print(
        f"\n{'k':>3} {'measured tok/s':>15} {'tok/round':>10} {'estimated tok/s (95%), k=' + str(k0) + ' run':>34}"
    )
    adv = advice[k0]
    for k in measured:
        est = adv.curve[k - 1].tokens_per_s if adv else None
        e = f"{est.value:9.1f} [{est.lo:7.1f}, {est.hi:7.1f}]" if est else "-"
        marks = [" <- best"] if k == best_k else []
        marks += [
            f" <- advised from k={s}" for s, a in advice.items() if a and a.recommended_k == k
        ]
        print(f"{k:>3} {measured[k]:>15.1f} {tpr[k]:>10.3f} {e:>34}{''.join(marks)}")
    print(f"plain loop: {plain:.1f} tok/s")
    runs = []
    for s, a in advice.items():
        if a is None:
            print(f"short run at k={s}: too few rounds for advice")
            continue
        ka, sp = a.recommended_k, a.estimated_speedup
        ratio, (pr, plo, phi) = measured[ka] / measured[best_k], paired(ka)
        spm = with_plain.estimated_speedup if s == k0 and with_plain else None
        runs.append(
            {
                "short_run_k": s,
                "recommended_k": ka,
                "measured_at_recommended": measured[ka],
                "ratio_vs_best": ratio,
                "goal_met": ratio >= 0.95,
                "paired_ratio_vs_best": [pr, plo, phi],
                "gain_vs_short_run_k": measured[ka] / measured[s],
                "estimated_speedup": list(sp),
                "estimated_speedup_measured_plain": list(spm) if spm else None,
                "measured_speedup_at_recommended": measured[ka] / plain,
                "advice": summary(a),
            }
        )
        print(
            f"from {short_n} rounds at k={s} (clock {a.clock}): advised k={ka}, measured "
            f"{measured[ka]:.1f} tok/s = {ratio:.3f} of the best (k={best_k}; goal >= 0.95), "
            f"{measured[ka] / measured[s]:.3f}x the loop's own k={s}; per repetition "
            f"{pr:.3f} (quartiles {plo:.3f}..{phi:.3f})"
        )
        print(
            f"  speedup over plain at k={ka}: estimated {sp.value:.3f} [{sp.lo:.3f}, {sp.hi:.3f}]"
            f" (plain step = verify fit at one row, {a.plain_step_ns / 1e6:.3f} ms"
            + (f"; {spm.value:.3f} with the measured plain step" if spm else "")
            + f"), measured {measured[ka] / plain:.3f}"
        )
    if const is not None:
        kc = const.recommended_k
        print(
            f"constant k={k0} (no gate): advised k={kc} ({measured[kc] / measured[best_k]:.3f} "
            f"of the best); {const.costs.assumption}"
        )
    out: dict[str, Any] = {
        "device": w.describe(),
        "clock": w.clock,
        "config": {
            "curve": args.curve,
            "planted_alpha": CURVES[args.curve][:kmax],
            "short_run_k": args.k,
            "short_rounds": short_n,
            "gate": 0.1,
            "sweep_rounds_per_repetition": sweep_n,
            "repeats": done,
            "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            "seed": args.seed,
        },
        "measured": [
            {"k": k, "tokens_per_s": v, "tokens_per_round": tpr[k], "runs": rates(k)}
            for k, v in measured.items()
        ],
        "best_k": best_k,
        "best_tokens_per_s": measured[best_k],
        "plain_tokens_per_s": plain,
        "measured_speedup_best": measured[best_k] / plain,
        "runs": runs,
        "advice_constant_k": summary(const),
        "advice_constant_k_ratio_vs_best": (
            measured[const.recommended_k] / measured[best_k] if const else None
        ),
        "elapsed_s": time.perf_counter() - t_start,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "advisor.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
