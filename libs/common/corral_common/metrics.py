"""Prometheus helpers: every service serves the standard exposition format on /metrics."""
from __future__ import annotations

import functools
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "corral_requests_total", "Bus requests handled", ["service", "op", "code"], registry=REGISTRY
)
REQUEST_SECONDS = Histogram(
    "corral_request_seconds",
    "Time to answer a bus request",
    ["service", "op"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)


@functools.cache
def _requests(service: str, op: str, code: str) -> Counter:
    return REQUESTS.labels(service, op, code)


@functools.cache
def _request_seconds(service: str, op: str) -> Histogram:
    return REQUEST_SECONDS.labels(service, op)


def request_done(service: str, op: str, code: str, seconds: float) -> None:
    """Count one answered bus request. Each labelled child is looked up once: prometheus-client's
    `labels()` validates and locks on every call, most of the cost of counting a request
    (bench/responder.py)."""
    _requests(service, op, code).inc()
    _request_seconds(service, op).observe(seconds)


UP = Gauge("corral_service_up", "1 while the service is serving", ["service"], registry=REGISTRY)


# where a process started with `--metrics-port 0` tells its parent the port it got (the embedded
# stack: ports picked ahead by the parent could be taken by the time the child binds them)
URL_FILE_ENV = "CORRAL_METRICS_URL_FILE"


def serve(host: str, port: int) -> str:
    """Start the /metrics HTTP endpoint; port 0 picks a free port. Returns the URL, also written
    to $CORRAL_METRICS_URL_FILE when that is set."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    url = f"http://{host}:{server.server_port}/metrics"
    path = os.environ.get(URL_FILE_ENV)
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(url + "\n")
        os.replace(tmp, path)
    return url


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, doc, list(labels), registry=REGISTRY)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(name, doc, list(labels), registry=REGISTRY)


def histogram(name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] | None = None) -> Histogram:
    return Histogram(name, doc, list(labels), registry=REGISTRY, buckets=buckets or Histogram.DEFAULT_BUCKETS)
