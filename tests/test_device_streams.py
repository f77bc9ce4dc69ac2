"""Stream adapters and import hygiene: frameworks are told apart by module name, the same
stream given twice is one stream, and a CPU-only use never imports cupy / torch / pynvml."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from memra_obs.device import event_clock as streams
from memra_obs.device.event_clock import DuckEvents, event_ops, framework, pair, same_stream

ROOT = Path(__file__).resolve().parent.parent


def fake_stream(module: str, handle: int, device: int = 0, attr: str = "ptr") -> Any:
    """An object whose type claims to live in ``module`` (as cupy/torch stream types do)."""
    cls = type("Stream", (), {"__module__": module, "synchronize": lambda self: None})
    s = cls()
    setattr(s, attr, handle)
    if module.startswith("cupy"):
        s.device_id = device
    else:
        s.device = type("Dev", (), {"index": device})()
    return s


def test_framework_is_read_off_the_type_module() -> None:
    """cupy.cuda.stream.Stream / torch.cuda.streams.Stream, without importing either."""
    assert framework(fake_stream("cupy.cuda.stream", 1)) == "cupy"
    assert framework(fake_stream("torch.cuda.streams", 1, attr="cuda_stream")) == "torch"
    assert framework(object()) is None
    assert framework(None) is None


def test_an_engines_subclass_of_a_framework_stream_is_that_frameworks() -> None:
    """An engine's own ``class EngineStream(torch.cuda.Stream)`` lives in the engine's module:
    read off the type alone it was no framework, its events were made with ``record_event()``
    (torch's have no timing) and the event clock dropped every round."""
    torch_stream = fake_stream("torch.cuda.streams", 7, attr="cuda_stream")
    engine = type("EngineStream", (type(torch_stream),), {"__module__": "engine.streams"})()
    engine.cuda_stream, engine.device = 7, torch_stream.device
    assert framework(engine) == "torch" and streams.stream_handle(engine) == 7
    assert same_stream(engine, torch_stream)
    # and CuPy's ExternalStream of that handle is the one stream too, as it always was
    assert same_stream(torch_stream, fake_stream("cupy.cuda.stream", 7))
    assert not same_stream(torch_stream, fake_stream("cupy.cuda.stream", 8))


def test_two_wrappers_of_one_stream_given_as_e_and_eh_drain_once() -> None:
    """The sync clock read ``eh is e``: ``e=current_stream(), eh=current_stream()`` (two
    wrappers of one stream) synchronized it twice at every boundary, as two streams."""
    from memra_obs.testing import capture

    syncs = []
    cls = type("Stream", (), {"__module__": "torch.cuda.streams",
                              "synchronize": lambda self: syncs.append(self)})  # fmt: skip
    a, b = cls(), cls()
    for w in (a, b):
        w.cuda_stream, w.device = 0xABC, type("Dev", (), {"index": 0})()
    with capture(level=1) as cap, cap.observer.session("t", e=a, eh=b) as sess:
        burst = sess.burst(4)
        syncs.clear()
        burst.begin_round()
        burst.end_draft()
    assert len(syncs) == 2  # two boundaries, one drain each


def test_two_wrappers_of_one_cuda_stream_are_one_stream() -> None:
    """torch.cuda.current_stream() hands out a new wrapper each call: same handle = same stream."""
    a = fake_stream("torch.cuda.streams", 0xABC, attr="cuda_stream")
    b = fake_stream("torch.cuda.streams", 0xABC, attr="cuda_stream")
    c = fake_stream("torch.cuda.streams", 0xABC, device=1, attr="cuda_stream")
    assert same_stream(a, b)
    assert not same_stream(a, c)  # handle 0x.. on another device is another stream
    assert pair(a, b) == (a, a)
    assert pair(a, c) == (a, c)
    assert pair(a, None) == (a, a)
    plain1, plain2 = object(), object()
    assert not same_stream(plain1, plain2)


def test_event_ops_for_duck_streams_and_none_for_plain_ones() -> None:
    """torch-style record_event() streams are event-timed; bare synchronizers are not."""

    class Duck:
        def synchronize(self) -> None:
            pass

        def record_event(self, ev: Any = None) -> Any:
            return ev

    assert isinstance(event_ops(Duck()), DuckEvents)
    assert event_ops(fake_stream("mylib", 1)) is None
    assert streams.stream_handle(object()) is None


def test_cupys_default_stream_is_the_current_devices(monkeypatch) -> None:
    """CuPy's ``Stream.null``, ``.ptds`` and ``ExternalStream`` say ``device_id`` -1 (the
    current device's). Taken as an ordinal, each event was made on device -1 (cudaErrorInvalid
    Device) and the event clock kept host stamps: on an H100, 53 ms of matmuls queued in a phase
    read 0.35 ms, said only as "making CUDA events failed"."""
    import types

    made: list[int | None] = []

    class Device:
        def __init__(self, d: int | None = None) -> None:
            self.d = d

        def __enter__(self) -> None:
            if self.d is not None and self.d < 0:
                raise RuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
            made.append(self.d)

        def __exit__(self, *exc: object) -> None:
            pass

    runtime = types.SimpleNamespace(getDevice=lambda: 1)
    cuda = types.SimpleNamespace(Device=Device, Event=object, runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    null, mine = fake_stream("cupy.cuda.stream", 0, device=-1), fake_stream("cupy.cuda.stream", 7)
    assert (streams.stream_device(null), streams.stream_device(mine)) == (1, 0)
    streams.CupyEvents().new(null)
    assert made == [1]  # made on the current device
    assert not same_stream(null, fake_stream("cupy.cuda.stream", 0, device=0))  # device 1's


POISON = """
import sys
raise ImportError("memra_obs imported {name} on a CPU-only path")
"""


def test_cpu_only_use_never_imports_gpu_libraries(tmp_path: Path) -> None:
    """import memra_obs, a traced session on the sync and event clocks with no device, the NVTX
    sink's absence, and the memory snapshot without a GPU: none imports cupy, torch, pynvml or
    nvtx. Poisoned stand-ins on the path make any such import fail loudly."""
    for name in ("cupy", "torch", "pynvml", "nvtx"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(POISON.format(name=name))
    script = textwrap.dedent(
        """
        import sys
        import memra_obs
        import memra_obs.device, memra_obs.device.event_clock
        import memra_obs.device.memory, memra_obs.device.workload, memra_obs.sinks.nvtx
        from memra_obs.testing import capture
        for clock in ("sync", "event"):
            with capture(level=2, prof=True, clock=clock, memory=lambda: []) as cap:
                with cap.observer.session("t") as s:
                    b = s.burst(4)
                    b.begin_round(); b.end_draft(); b.end_verify(); b.end_accept(); b.end_rollback()
                    b.end_round(k=4, j=1)
                    b.end()
        bad = sorted(m for m in ("cupy", "torch", "pynvml", "nvtx") if m in sys.modules)
        print("LOADED", bad)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout


def test_memory_snapshot_with_poisoned_libraries_is_empty_and_quiet(tmp_path: Path) -> None:
    """free_mb_snapshot where pynvml/cupy/torch fail to import: [] and no traceback."""
    for name in ("cupy", "torch", "pynvml"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    script = (
        "from memra_obs.device.memory import free_mb_snapshot; print('SNAP', free_mb_snapshot())"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "SNAP []" in out.stdout
