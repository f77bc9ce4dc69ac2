"""An exporter whose ``export`` waits for ``release``: a batch held inside its call (a stuck
collector), for the flush and shutdown tests."""

from __future__ import annotations

import threading


class Held:
    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, batch: object) -> None:
        self.release.wait(5)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass
