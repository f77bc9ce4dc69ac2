"""``memra-obs demo --gpu``: the demo's loop on real kernels with spec-like shapes.

Same duck-typed interface as :class:`memra_obs.demo.SimWorkload` (``e``, ``eh``, ``ctx`` and one
method per phase). Every phase only *queues* work on ``e`` (and ``eh`` with ``two_streams``)
and returns; the only host waits are the ones a spec loop really has — the accept walk's
device→host readback and the anchor draw's — so the phase clock decides where device time
lands. Shapes, fp16, loosely a 30B-class target with a small drafter:

* ``cache_alloc``: the trunk KV cache, ``layers x 2 x ctx x kv_dim`` (96 KiB a token by
  default: a 2k-token session takes ~200 MiB, a 32k one ~3 GiB — free memory visibly moves);
  allocated with plain ``cudaMalloc`` and given back at ``end_session``.
* ``prime``: the prompt in 512-row chunks — K/V projections into the cache per layer + an FFN.
* ``draft(k)``: ``k`` sequential drafter steps, each a few small matmuls, an lm-head and a
  device-side argmax feeding the next step.
* ``verify(k)``: one batched pass over ``k+1`` rows — attention over the cache and a large FFN
  (two ``hidden x ffn`` weights, ~470 MB) per layer, then the lm-head.
* ``accept(k)``: argmax over the verify logits and a readback; ``j`` is derived from the read
  values (about 70% per-token acceptance), so it is a real device→host dependency.
* ``rollback(k, j)``: commits the accepted prefix — a slice copy of the verify's K/V rows into
  the cache; ``maint``: small copies into the drafter's ring.

CuPy or torch, whichever is installed (CuPy first; ``backend=`` to choose). The framework is
imported when the workload is built, never at import.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

__all__ = ["GpuWorkload"]


class _CupyOps:
    name = "cupy"

    def __init__(self, device: int) -> None:
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device(device)
        self.f16 = cupy.float16

    def stream(self) -> Any:
        with self.device:
            return self.cp.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def on(self, s: Any) -> Iterator[None]:
        with self.device, s:
            yield

    def empty(self, shape: tuple[int, ...]) -> Any:
        return self.cp.empty(shape, dtype=self.f16)

    def raw_empty(self, shape: tuple[int, ...]) -> Any:
        """Outside the memory pool: a plain cudaMalloc that ``del`` gives back to the device."""
        n = 2
        for d in shape:
            n *= d
        mem = self.cp.cuda.Memory(max(n, 2))
        return self.cp.ndarray(shape, self.f16, self.cp.cuda.MemoryPointer(mem, 0))

    def randn(self, shape: tuple[int, ...], scale: float) -> Any:
        return (self.cp.random.standard_normal(shape, dtype=self.cp.float32) * scale).astype(
            self.f16
        )

    def mm(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.cp.matmul(a, b, out=out)

    def argmax(self, x: Any) -> Any:
        return self.cp.argmax(x, axis=-1)

    def take(self, w: Any, idx: Any) -> Any:
        return self.cp.take(w, idx.reshape(-1), axis=0)

    def copy(self, dst: Any, src: Any) -> None:
        self.cp.copyto(dst, src)

    def host(self, x: Any, s: Any) -> Any:
        return x.get(stream=s)

    def wait(self, dst: Any, src: Any) -> None:
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(src)
        dst.wait_event(ev)

    def synchronize(self) -> None:
        self.device.synchronize()

    def release(self) -> None:
        self.cp.get_default_memory_pool().free_all_blocks()


class _TorchOps:
    name = "torch"

    def __init__(self, device: int) -> None:
        import torch

        self.t = torch
        self.device = torch.device("cuda", device)
        self.f16 = torch.float16

    def stream(self) -> Any:
        return self.t.cuda.Stream(device=self.device)

    @contextlib.contextmanager
    def on(self, s: Any) -> Iterator[None]:
        with self.t.cuda.device(self.device), self.t.cuda.stream(s):
            yield

    def empty(self, shape: tuple[int, ...]) -> Any:
        return self.t.empty(shape, dtype=self.f16, device=self.device)

    raw_empty = empty  # end_session's empty_cache() gives it back

    def randn(self, shape: tuple[int, ...], scale: float) -> Any:
        return self.t.randn(shape, dtype=self.f16, device=self.device) * scale

    def mm(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.t.matmul(a, b) if out is None else self.t.matmul(a, b, out=out)

    def argmax(self, x: Any) -> Any:
        return x.argmax(dim=-1)

    def take(self, w: Any, idx: Any) -> Any:
        return self.t.index_select(w, 0, idx.reshape(-1))

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def host(self, x: Any, s: Any) -> Any:
        return x.cpu().numpy()

    def wait(self, dst: Any, src: Any) -> None:
        dst.wait_stream(src)

    def synchronize(self) -> None:
        self.t.cuda.synchronize(self.device)

    def release(self) -> None:
        self.t.cuda.empty_cache()


def _ops(backend: str | None, device: int) -> Any:
    import importlib.util

    names = [backend] if backend else ["cupy", "torch"]
    errors = []
    for n in names:
        if n not in ("cupy", "torch"):
            raise ValueError(f"backend={n!r}: expected 'cupy' or 'torch'")
        if importlib.util.find_spec(n) is None:
            errors.append(f"{n} is not installed")
            continue
        try:
            return _CupyOps(device) if n == "cupy" else _TorchOps(device)
        except Exception as exc:
            errors.append(f"{n}: {exc!r}")
    raise RuntimeError("memra-obs demo --gpu needs CuPy or a CUDA torch: " + "; ".join(errors))


class GpuWorkload:
    """One loop's worth of spec-shaped kernels on one GPU (see the module doc)."""

    #: Trunk: hidden, FFN width, layers, KV width per layer (K and V each), vocabulary.
    HIDDEN = 4096
    FFN = 28672
    LAYERS = 16
    KV_DIM = 1536
    VOCAB = 32000
    #: Drafter: hidden, layers, its KV width.
    D_HIDDEN = 2048
    D_LAYERS = 2
    D_KV = 256
    #: Prompt rows per prime chunk; cap on a session's KV cache.
    CHUNK = 512
    MAX_CACHE_BYTES = 24 << 30

    def __init__(
        self,
        backend: str | None = None,
        device: int = 0,
        *,
        two_streams: bool = False,
        layers: int | None = None,
        seed: int | None = None,
    ) -> None:
        x = _ops(backend, device)
        # Acceptance is drawn on the host per session (random weights give meaningless
        # argmaxes); the device still computes and reads back the argmax, as a real accept.
        self.rng = random.Random(seed)
        self.alpha = 0.7
        self.x = x
        self.backend = x.name
        self.layers = self.LAYERS if layers is None else layers
        self.e: Any = x.stream()
        self.eh: Any = x.stream() if two_streams else self.e
        self.ctx = 0
        self._cap = 0
        self._cache: Any = None
        self._dkv: Any = None
        self._step = 0
        H, F, V, D = self.HIDDEN, self.FFN, self.VOCAB, self.KV_DIM
        Hd = self.D_HIDDEN
        with x.on(self.e):
            s = 0.02
            self.emb = x.randn((V, H), 1.0)
            self.w1 = x.randn((H, F), s)
            self.w2 = x.randn((F, H), s)
            self.wk = x.randn((H, D), s)
            self.wv = x.randn((H, D), s)
            self.wo = x.randn((D, H), s)
            self.lm = x.randn((H, V), s)
            self.d_emb = x.randn((V, Hd), 1.0)
            self.d_w1 = x.randn((Hd, 4 * Hd), s)
            self.d_w2 = x.randn((4 * Hd, Hd), s)
            self.d_lm = x.randn((Hd, V), s)
            self.d_fc = x.randn((H, Hd), s)
            self.d_wkv = x.randn((Hd, self.D_KV), s)
            self.d_ring = x.empty((64, Hd))
            self.prefix = x.empty((1, H))
            self.kmax = 16
            self.scratch = x.empty((self.layers, 2, self.kmax + 1, D))
            self.h_last = x.empty((1, H))
            self.toks: Any = None
            self.vlogits: Any = None
            self.prime_logits: Any = None
        x.synchronize()

    # -- session creation ----------------------------------------------------------------

    def cache_alloc(self, ctx: int) -> None:
        per_token = self.layers * 2 * self.KV_DIM * 2
        cap = max(64, min(ctx, self.MAX_CACHE_BYTES // per_token))
        with self.x.on(self.e):
            self._cache = self.x.raw_empty((self.layers, 2, cap, self.KV_DIM))
        self._cap = cap
        self.ctx = 0

    def _rows(self, n: int, a: int) -> Any:
        x = self.x
        idx = x.argmax(x.randn((n, 8), 1.0)) + a  # device-side token ids, no host round trip
        return x.take(self.emb, idx % self.VOCAB)

    def prime(self, prompt_tokens: int) -> None:
        x = self.x
        self.alpha = min(0.95, max(0.2, self.rng.betavariate(7, 3)))  # this request's acceptance
        n = max(1, min(prompt_tokens, self._cap - self.kmax - 1))
        with x.on(self.e):
            h: Any = None
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
        x = self.x
        with x.on(self.e):
            tok = x.argmax(self.prime_logits)
            self._anchor_token = int(x.host(tok, self.e).reshape(-1)[0])

    def draft_alloc(self, ctx: int) -> None:
        with self.x.on(self.e):
            self._dkv = self.x.raw_empty(
                (self.D_LAYERS, 2, max(64, min(ctx, self._cap)), self.D_KV)
            )

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

    # -- the round -----------------------------------------------------------------------

    def draft(self, k: int) -> None:
        x = self.x
        k = max(1, min(k, self.kmax))
        with x.on(self.e):
            h = x.mm(self.h_last, self.d_fc)
            toks = []
            for _ in range(k):
                h = x.mm(x.mm(h, self.d_w1), self.d_w2)
                tok = x.argmax(x.mm(h, self.d_lm))
                toks.append(tok.reshape(1))
                h = x.take(self.d_emb, tok)
            self.toks = toks

    def verify(self, k: int) -> None:
        x = self.x
        k = max(1, min(k, self.kmax))
        t = k + 1
        ctx = self.ctx
        with x.on(self.e):
            rows = [self.h_last, *(x.take(self.emb, tok) for tok in (self.toks or [])[:k])]
            h = rows[0] if len(rows) == 1 else _cat(x, rows)
            if h.shape[0] < t:
                h = _cat(x, [h, *([self.h_last] * (t - h.shape[0]))])
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
        """Argmax over the verify logits, read back; ``j`` from the values read."""
        x = self.x
        k = max(1, min(k, self.kmax))
        with x.on(self.eh):
            ids = x.host(x.argmax(self.vlogits), self.eh).reshape(-1).tolist()
        j = 0
        while j < k and j < len(ids) and self.rng.random() < self.alpha:
            j += 1
        self._j_row = j
        return j

    def rollback(self, k: int, j: int) -> None:
        """Commit the accepted prefix (j drafts + the bonus row) into the cache: a slice copy."""
        x = self.x
        n = min(j + 1, self.kmax + 1)
        c = self.ctx
        if c + n > self._cap:  # a full cache wraps (the demo's sessions are sized to fit)
            c = 0
        with x.on(self.e):
            x.copy(self._cache[:, :, c : c + n], self.scratch[:, :, :n])
            x.copy(self.h_last, self._h[n - 1 : n])
        self.ctx = c + n

    def maint(self) -> None:
        """Draft-source maintenance: the new hidden row into the drafter's ring."""
        x = self.x
        with x.on(self.e):
            slot = self._step % self.d_ring.shape[0]
            x.copy(self.d_ring[slot : slot + 1], x.mm(self.h_last, self.d_fc))
        self._step += 1

    def end_session(self) -> None:
        """Drain and give the session's KV memory back to the device."""
        self.e.synchronize()
        if self.eh is not self.e:
            self.eh.synchronize()
        self._cache = None
        self._dkv = None
        self.ctx = 0
        self._cap = 0
        self.x.release()


def _cat(x: Any, parts: list[Any]) -> Any:
    if x.name == "cupy":
        return x.cp.concatenate(parts, axis=0)
    return x.t.cat(parts, dim=0)
