"""Prometheus metrics: per-worker counters (accepted, rejected by reason, tokens, in flight), and an exporter that
publishes the ledger's run-wide counts (`eagle3q exporter`), which add up across all workers and machines."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily

from eagle3q.contract import SAMPLE_STAGES


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._accepted = Counter("eagle3q_samples_accepted", "accepted samples", registry=self.registry)
        self._rejected = Counter(
            "eagle3q_samples_rejected", "rejected samples", ["stage", "reason"], registry=self.registry
        )
        self._tokens = Counter("eagle3q_generated_tokens", "generated tokens accepted", registry=self.registry)
        self._in_flight = Gauge("eagle3q_requests_in_flight", "requests to vLLM in flight", registry=self.registry)
        self._hidden = Counter("eagle3q_hidden_states_written", "hidden-state files written", registry=self.registry)

    def accepted(self, tokens: int) -> None:
        self._accepted.inc()
        self._tokens.inc(tokens)

    def rejected(self, stage: str, reason: str) -> None:
        self._rejected.labels(stage, reason).inc()

    def in_flight(self, delta: int) -> None:
        self._in_flight.inc(delta)

    def hidden_written(self, n: int = 1) -> None:
        self._hidden.inc(n)

    def serve(self, port: int):  # noqa: ANN201 - the HTTP server (its `shutdown()` stops it)
        started = start_http_server(port, registry=self.registry)
        return started[0] if isinstance(started, tuple) else started


METRICS = WorkerMetrics()


class LedgerCollector:
    """Collects the run-wide counts from Redis at scrape time."""

    def __init__(self, ledger) -> None:  # noqa: ANN001 - eagle3q.control.ledger.Ledger
        self.ledger = ledger

    def collect(self):  # noqa: ANN201
        done = GaugeMetricFamily("eagle3q_run_done", "samples done per run and stage", labels=["run", "stage"])
        rej = GaugeMetricFamily("eagle3q_run_rejected", "rejections per run, stage, reason",
                                labels=["run", "stage", "reason"])
        pend = GaugeMetricFamily("eagle3q_run_pending", "samples still queued per run and stage",
                                 labels=["run", "stage"])
        rate = GaugeMetricFamily("eagle3q_run_rate", "samples/s over the last minute", labels=["run", "stage"])
        for run in self.ledger.runs():
            for stage in SAMPLE_STAGES:
                c = self.ledger.counts(run, stage)
                done.add_metric([run, stage], c.done)
                pend.add_metric([run, stage], c.pending)
                rate.add_metric([run, stage], c.rate)
                for reason, n in c.reasons.items():
                    rej.add_metric([run, stage, reason], n)
        yield from (done, rej, pend, rate)


def serve_ledger_exporter(ledger, port: int) -> None:  # noqa: ANN001
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    start_http_server(port, registry=registry)
    while True:
        time.sleep(3600)
