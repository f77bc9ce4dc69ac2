"""The agent's own health on its ``/metrics``: rings attached, records published and lost
per worker. Read at scrape time from the agent's counters (nothing is counted twice).

The host-wide loss also goes out as ``memra_obs_dropped_total{signal="ring"}`` through the
PrometheusExporter's ``watch`` (see :func:`memra_obs.agent.wire_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .loop import Agent

__all__ = ["AgentCollector"]


class AgentCollector(Collector):
    """``memra_obs_agent_rings``, ``memra_obs_agent_records_total{worker}``,
    ``memra_obs_agent_lost_records_total{worker}``."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def describe(self) -> Iterator[Any]:
        yield GaugeMetricFamily("memra_obs_agent_rings", "Worker rings the agent is reading.")
        yield CounterMetricFamily(
            "memra_obs_agent_records", "Records published.", labels=["worker"]
        )
        yield CounterMetricFamily(
            "memra_obs_agent_lost_records", "Records lost.", labels=["worker"]
        )

    def collect(self) -> Iterator[Any]:
        a = self._agent
        pub, lost = a.worker_counts()
        yield GaugeMetricFamily(
            "memra_obs_agent_rings", "Worker rings the agent is reading (one per worker process).",
            value=a.rings,
        )  # fmt: skip
        c = CounterMetricFamily(
            "memra_obs_agent_records",
            "Records the agent read from a worker's ring and published (replayed session "
            "context and synthesized session ends included).",
            labels=["worker"],
        )
        for w, n in sorted(pub.items()):
            c.add_metric([w], n)
        yield c
        c = CounterMetricFamily(
            "memra_obs_agent_lost_records",
            "Records of a worker that never reached the exporters: overwritten in its ring "
            "before the agent read them, refused by the writer, or without a session context.",
            labels=["worker"],
        )
        for w, n in sorted(lost.items()):
            c.add_metric([w], n)
        yield c
