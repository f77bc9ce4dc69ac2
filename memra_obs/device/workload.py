"""``memra-obs demo --gpu``: the demo's loop (:class:`memra_obs.demo.SimWorkload`'s interface) on
real kernels with spec-like shapes (fp16, loosely a 30B-class target with a small drafter), on
CuPy or else torch. Phases only *queue* work on ``e`` (and ``eh``); the only host waits are a spec
loop's own (the accept readback, the anchor draw), so the phase clock decides where device time
lands. The KV cache (96 KiB a token) is allocated per session and given back: free memory moves;
concurrent loops share one copy of the weights (``weights_of``), as a server's requests do.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

__all__ = ["GpuUnavailable", "GpuWorkload"]


class GpuUnavailable(RuntimeError):
    """No CUDA device through CuPy or torch; the message is one line saying why."""


class _Ops:
    """The array operations the workload uses; each queues on the current stream."""

    name = ""
    m: Any  # the framework module

    def mm(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.m.matmul(a, b, out=out)

    def argmax(self, x: Any) -> Any:
        return self.m.argmax(x, -1)

    def take(self, w: Any, idx: Any) -> Any:
        return w[idx.reshape(-1)]

    def copy(self, dst: Any, src: Any) -> None:
        dst[...] = src


class _CupyOps(_Ops):
    name = "cupy"

    def __init__(self, device: int) -> None:
        import cupy as cp

        self.m, self.device = cp, cp.cuda.Device(device)
        self.empty = lambda shape: cp.empty(shape, dtype=cp.float16)
        self.randn = lambda shape, scale: (
            cp.random.standard_normal(shape, dtype=cp.float32) * scale
        ).astype(cp.float16)
        self.cat = lambda parts: cp.concatenate(parts, 0)
        self.host = lambda x, s: x.get(stream=s)
        self.synchronize = self.device.synchronize
        self.release = cp.get_default_memory_pool().free_all_blocks

    def stream(self) -> Any:
        with self.device:
            return self.m.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def on(self, s: Any) -> Iterator[None]:
        with self.device, s:
            yield

    def wait(self, dst: Any, src: Any) -> None:
        ev = self.m.cuda.Event(disable_timing=True)
        ev.record(src)
        dst.wait_event(ev)


class _TorchOps(_Ops):
    name = "torch"

    def __init__(self, device: int) -> None:
        import torch as t

        self.m, self.device = t, t.device("cuda", device)
        self.empty = lambda shape: t.empty(shape, dtype=t.float16, device=self.device)
        self.randn = lambda shape, scale: (
            t.randn(shape, dtype=t.float16, device=self.device) * scale
        )
        self.cat = lambda parts: t.cat(parts, 0)
        self.host = lambda x, s: x.cpu().numpy()
        self.synchronize = lambda: t.cuda.synchronize(self.device)
        self.release = t.cuda.empty_cache
        self.stream = lambda: t.cuda.Stream(device=self.device)
        self.wait = lambda dst, src: dst.wait_stream(src)

    @contextlib.contextmanager
    def on(self, s: Any) -> Iterator[None]:
        with self.m.cuda.device(self.device), self.m.cuda.stream(s):
            yield


def _ops(backend: str | None, device: int) -> Any:
    """CuPy, else torch (or ``backend``) on ``device``; GpuUnavailable when neither can."""
    errors = []
    for n in [backend] if backend else ["cupy", "torch"]:
        if n not in ("cupy", "torch"):
            raise ValueError(f"backend={n!r}: expected 'cupy' or 'torch'")
        try:
            x: Any = _CupyOps(device) if n == "cupy" else _TorchOps(device)
            x.stream()  # fails here, not in the first phase, without a device
            return x
        except ModuleNotFoundError:
            errors.append(f"{n} is not installed")
        except Exception as exc:
            errors.append(f"{n}: {_first_line(exc)}")
    why = "; ".join(errors)
    if all(e.endswith(" is not installed") for e in errors):
        why += (
            " (pip install 'memra_obs[cuda12]' or 'memra_obs[cuda13]', as the driver's CUDA,"
            " or a CUDA torch)"
        )
    raise GpuUnavailable(f"--gpu needs a CUDA device through CuPy or torch: {why}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class GpuWorkload:
    """One loop's worth of spec-shaped kernels on one GPU (see the module doc)."""

    #: Trunk: hidden, FFN width, layers, K (and V) width per layer, vocabulary; the drafter's
    #: hidden, layers and KV width; prompt rows per prime chunk; cap on a session's KV cache.
    HIDDEN, FFN, LAYERS, KV_DIM, VOCAB = 4096, 28672, 16, 1536, 32000
    D_HIDDEN, D_LAYERS, D_KV = 2048, 2, 256
    CHUNK, MAX_CACHE_BYTES, KMAX = 512, 24 << 30, 64  # the demo's --k: 1..64

    #: The model: read-only, so concurrent loops share one copy (``weights_of``), as a server's
    #: requests do; 64 private copies (1.3 GB each) did not fit an 80 GB card.
    WEIGHTS: tuple[str, ...] = ("emb", "d_emb", "w1", "w2", "lm", "wk", "wv", "wo")
    WEIGHTS += ("d_w1", "d_w2", "d_lm", "d_fc", "d_wkv")

    def __init__(
        self,
        backend: str | None = None,
        *,
        two_streams: bool = False,
        seed: int | None = None,
        weights_of: GpuWorkload | None = None,
    ) -> None:
        if weights_of is not None:
            backend = weights_of.x.name
        self.x: Any = _ops(backend, 0)
        x = self.x
        # Acceptance is drawn on the host per session (random weights make argmaxes
        # meaningless); the device still computes and reads back the argmax, as a real accept.
        self.rng, self.alpha = random.Random(seed), 0.7
        self.layers = self.LAYERS
        self.e: Any = x.stream()
        self.eh: Any = x.stream() if two_streams else self.e
        self.ctx = self._cap = self._step = 0
        self._cache: Any = None
        self._dkv: Any = None
        self.toks: list[Any] = []
        H, F, V, D, Hd, s = self.HIDDEN, self.FFN, self.VOCAB, self.KV_DIM, self.D_HIDDEN, 0.02
        with x.on(self.e):
            if weights_of is not None:
                for name in self.WEIGHTS:
                    setattr(self, name, getattr(weights_of, name))
            else:
                self.emb, self.d_emb = x.randn((V, H), 1.0), x.randn((V, Hd), 1.0)
                self.w1, self.w2 = x.randn((H, F), s), x.randn((F, H), s)
                self.wk, self.wv = x.randn((H, D), s), x.randn((H, D), s)
                self.wo, self.lm = x.randn((D, H), s), x.randn((H, V), s)
                self.d_w1, self.d_w2 = x.randn((Hd, 4 * Hd), s), x.randn((4 * Hd, Hd), s)
                self.d_lm, self.d_fc = x.randn((Hd, V), s), x.randn((H, Hd), s)
                self.d_wkv = x.randn((Hd, self.D_KV), s)
            self.d_ring = x.empty((64, Hd))
            self.prefix, self.h_last = x.empty((1, H)), x.empty((1, H))
            self.scratch = x.empty((self.layers, 2, self.KMAX + 1, D))
            self.prime_logits = self.vlogits = self._h = self.h_last
        x.synchronize()
        x.release()  # nothing cached: a session's cache is fresh device memory

    def cache_alloc(self, ctx: int) -> None:
        per_token = self.layers * 2 * self.KV_DIM * 2
        # at least a prompt row and a whole round (KMAX + 1 rows: the wrap starts over at 0)
        self._cap = max(2 * (self.KMAX + 1), min(ctx, self.MAX_CACHE_BYTES // per_token))
        with self.x.on(self.e):
            self._cache = self.x.empty((self.layers, 2, self._cap, self.KV_DIM))
        self.ctx = 0

    def _rows(self, n: int, a: int) -> Any:
        x = self.x
        idx = x.argmax(x.randn((n, 8), 1.0)) + a  # device-side token ids, no host round trip
        return x.take(self.emb, idx % self.VOCAB)

    def prime(self, prompt_tokens: int) -> None:
        """The prompt in 512-row chunks: K/V projections into the cache per layer, an FFN."""
        x = self.x
        self.alpha = min(0.95, max(0.2, self.rng.betavariate(7, 3)))  # this request's acceptance
        n = max(1, min(prompt_tokens, self._cap - self.KMAX - 1))
        with x.on(self.e):
            for a in range(0, n, self.CHUNK):
                b = min(n, a + self.CHUNK)
                h = self._rows(b - a, a)
                for layer in range(self.layers):
                    x.mm(h, self.wk, out=self._cache[layer, 0, a:b])
                    x.mm(h, self.wv, out=self._cache[layer, 1, a:b])
                h = x.mm(x.mm(h, self.w1), self.w2)
            x.copy(self.h_last, h[-1:])
            self.prime_logits = x.mm(self.h_last, self.lm)
        self.ctx = n

    def capture(self) -> None:
        with self.x.on(self.e):
            self.x.copy(self.prefix, self.h_last)

    def anchor(self) -> None:
        """The boundary token draw: a greedy argmax read back to the host."""
        with self.x.on(self.e):
            self.x.host(self.x.argmax(self.prime_logits), self.e)

    def draft_alloc(self, ctx: int) -> None:
        shape = (self.D_LAYERS, 2, max(64, min(ctx, self._cap)), self.D_KV)
        with self.x.on(self.e):
            self._dkv = self.x.empty(shape)

    def draft_prime(self, prompt_tokens: int) -> None:
        x = self.x
        n = max(1, min(prompt_tokens, self._dkv.shape[2]))
        with x.on(self.e):
            for a in range(0, n, self.CHUNK):
                b = min(n, a + self.CHUNK)
                feats = x.mm(self._rows(b - a, a), self.d_fc)
                for layer in range(self.D_LAYERS):
                    x.mm(feats, self.d_wkv, out=self._dkv[layer, 0, a:b])
                    x.mm(feats, self.d_wkv, out=self._dkv[layer, 1, a:b])

    def draft(self, k: int) -> None:
        """``k`` sequential drafter steps: small matmuls, lm-head, device-side argmax."""
        x = self.x
        with x.on(self.e):
            h = x.mm(self.h_last, self.d_fc)
            self.toks = []
            for _ in range(max(1, min(k, self.KMAX))):
                h = x.mm(x.mm(h, self.d_w1), self.d_w2)
                tok = x.argmax(x.mm(h, self.d_lm))
                self.toks.append(tok.reshape(1))
                h = x.take(self.d_emb, tok)

    def verify(self, k: int) -> None:
        """One pass over ``k+1`` rows: attention over the cache and a ~470 MB FFN per layer,
        then the lm-head (on ``eh``)."""
        x, ctx = self.x, self.ctx
        t = max(1, min(k, self.KMAX)) + 1
        with x.on(self.e):
            rows = [self.h_last, *(x.take(self.emb, tok) for tok in self.toks[: t - 1])]
            h = x.cat(rows + [self.h_last] * (t - len(rows)))
            for layer in range(self.layers):
                q = x.mm(h, self.wk)
                x.copy(self.scratch[layer, 0, :t], q)
                x.mm(h, self.wv, out=self.scratch[layer, 1, :t])
                if ctx:
                    att = x.mm(x.mm(q, self._cache[layer, 0, :ctx].T), self._cache[layer, 1, :ctx])
                    h = h + x.mm(att, self.wo) * 0.001
                h = x.mm(x.mm(h, self.w1), self.w2)
            self._h = h
        if self.eh is not self.e:
            x.wait(self.eh, self.e)
        with x.on(self.eh):
            self.vlogits = x.mm(h, self.lm)

    def accept(self, k: int) -> int:
        """Argmax over the verify logits, read back; ``j`` drawn after the values arrive."""
        with self.x.on(self.eh):
            n = len(self.x.host(self.x.argmax(self.vlogits), self.eh).reshape(-1))
        j, k = 0, min(max(1, min(k, self.KMAX)), n)
        while j < k and self.rng.random() < self.alpha:
            j += 1
        return j

    def rollback(self, k: int, j: int) -> None:
        """Commit the accepted prefix (j drafts + the bonus row) into the cache: a slice copy."""
        n = min(j + 1, self.KMAX + 1)
        c = 0 if self.ctx + n > self._cap else self.ctx  # a full cache wraps
        with self.x.on(self.e):
            self.x.copy(self._cache[:, :, c : c + n], self.scratch[:, :, :n])
            self.x.copy(self.h_last, self._h[n - 1 : n])
        self.ctx = c + n

    def maint(self) -> None:
        """Draft-source maintenance: the new hidden row into the drafter's ring."""
        x, slot = self.x, self._step % 64
        with x.on(self.e):
            x.copy(self.d_ring[slot : slot + 1], x.mm(self.h_last, self.d_fc))
        self._step += 1

    def end_session(self) -> None:
        """Drain and give the session's KV memory back to the device."""
        self.e.synchronize()
        self.eh.synchronize()
        self._cache = self._dkv = None
        self.ctx = self._cap = 0
        self.x.release()
