"""``GET /metrics``: Prometheus metrics (``prometheus_client``), one registry per app.

- ``prism_http_requests_total{method, route, status}``: answers by route template (an
  unmatched path is ``unmatched``) and method (:func:`method_label`: every label value is from a
  fixed set, so a client cannot add series by inventing paths or methods).
- ``prism_intake_total{outcome}``: submission requests by outcome (``accepted`` or the
  error code: ``bad-signature``, ``zip-bomb``, ...).
- ``prism_intake_seconds``: the intake's time (unpack, gates, hashes), seconds.
- ``prism_submissions{status}``: submissions under the profile by status, read from the
  database at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from prism_challenge.service.models import STATUSES, Submission
from prism_challenge.service.store import Store


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
"""The methods of RFC 9110 section 9 and PATCH (RFC 5789): the ``method`` label's values, with ``other``."""


def method_label(method: str) -> str:
    """``method`` when it is one of :data:`HTTP_METHODS`, else ``other`` (the server accepts
    any token as a method; each new label value would be a new time series)."""
    return method if method in HTTP_METHODS else "other"


class _StatusCollector(Collector):
    def __init__(self, store: Store, profile: str):
        self.store, self.profile = store, profile

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("prism_submissions", "submissions under the service's profile by status",
                                  labels=["status"])
        with self.store.sessions() as s:
            counts = dict(s.execute(select(Submission.status, func.count()).where(Submission.profile == self.profile)
                                    .group_by(Submission.status)).all())
        for status in STATUSES:
            gauge.add_metric([status], counts.get(status, 0))
        yield gauge


class ServiceMetrics:
    """The app's metrics on a registry of its own (two apps in one process do not collide)."""

    def __init__(self, store: Store, profile: str):
        self.registry = CollectorRegistry()
        self.requests = Counter("prism_http_requests", "HTTP answers", ["method", "route", "status"],
                                registry=self.registry)
        self.intake = Counter("prism_intake", "submission requests by outcome", ["outcome"], registry=self.registry)
        self.intake_seconds = Histogram("prism_intake_seconds", "intake time: unpack, gates, hashes (s)",
                                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=self.registry)
        self.registry.register(_StatusCollector(store, profile))


__all__ = ["HTTP_METHODS", "ServiceMetrics", "method_label"]
