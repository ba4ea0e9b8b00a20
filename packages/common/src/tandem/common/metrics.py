"""Prometheus metrics: one registry per component, served on `/metrics` when configured.

A component builds one `MetricsEndpoint`, declares its counters, gauges and histograms on it
(`endpoint.counter(...)`), updates them where the events happen, and may add `gauge_fn`s read at
scrape time from state it already keeps (the buffer's counts, the RPC server's error tally), so
nothing is counted twice. The registry is the component's own, not the process-wide default:
components embedded in one process (tests, a notebook) never mix their numbers.

Every metric name starts with `tandem_` and the component; `component` and `name` labels say
whose it is on a dashboard that scrapes several (see docs/metrics.md).
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from collections.abc import Callable, Sequence

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .config.logs import PORT_OFFSETS, MetricsConfig
from .errors import ConfigError

log = structlog.get_logger(__name__)

# sleep / wake: a colocated explorer's engine releasing and retaking its weights
SPAN_KINDS = ("train", "rollout", "wait", "sync", "publish", "eval", "sleep", "wake")
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _ReadAtScrape(Collector):
    """Gauges whose values a function returns when Prometheus scrapes."""

    def __init__(self) -> None:
        self._gauges: list[tuple[str, str, Sequence[str], Callable[[], object]]] = []

    def add(self, name: str, doc: str, labels: Sequence[str], fn: Callable[[], object]) -> None:
        self._gauges.append((name, doc, tuple(labels), fn))

    def collect(self):
        for name, doc, labels, fn in self._gauges:
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            try:
                value = fn()
            except Exception:  # a scrape must never take the component down
                log.debug("metrics.read_failed", metric=name, exc_info=True)
                continue
            if labels:
                for key, v in dict(value).items():
                    family.add_metric(list(key) if isinstance(key, tuple) else [str(key)],
                                      float(v))
            else:
                family.add_metric([], float(value))
            yield family


class MetricsEndpoint:
    """One component's metrics; `start()` serves them on the configured address (if enabled)."""

    def __init__(self, config: MetricsConfig, component: str, name: str | None = None, *,
                 index: int = 0, run_dir: str | Path | None = None):
        if component not in PORT_OFFSETS:
            raise ValueError(f"unknown component {component!r} (have {sorted(PORT_OFFSETS)})")
        self.config = config
        self.component = component
        self.name = name or component
        self.index = index
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.registry = CollectorRegistry(auto_describe=True)
        self._scrape = _ReadAtScrape()
        self.registry.register(self._scrape)
        self._server = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.enabled)

    @property
    def port(self) -> int:
        """The port this component serves on (0: a free one, chosen when it starts)."""
        if self.config.port == 0:
            return 0
        return self.config.port + PORT_OFFSETS[self.component] + self.index

    def _full(self, metric: str) -> str:
        return f"tandem_{self.component}_{metric}"

    def counter(self, metric: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self._full(metric), doc, labelnames=labels, registry=self.registry)

    def gauge(self, metric: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self._full(metric), doc, labelnames=labels, registry=self.registry)

    def histogram(self, metric: str, doc: str, buckets: Sequence[float] = SECONDS_BUCKETS,
                  labels: Sequence[str] = ()) -> Histogram:
        return Histogram(self._full(metric), doc, labelnames=labels, buckets=buckets,
                         registry=self.registry)

    def gauge_fn(self, metric: str, doc: str, fn: Callable[[], object],
                 labels: Sequence[str] = ()) -> None:
        """A gauge read from `fn()` at scrape time; with `labels`, `fn` returns {label: value}."""
        self._scrape.add(self._full(metric), doc, labels, fn)

    def observe_spans(self, tracer) -> None:
        """Time the component's trace spans: `span_seconds{kind, what}` (train and rollout
        steps, waits for barriers and samples, weight syncs), the tokens they carry and the
        bytes a weight sync moved."""
        seconds = self.histogram("span_seconds", "duration of train / rollout / wait / sync spans",
                                 labels=("kind", "what"))
        tokens = self.counter("tokens", "tokens in train and rollout spans")
        sync_bytes = self.counter("weight_sync_bytes", "bytes moved by weight syncs")

        def observe(kind: str, span_seconds: float, attrs: dict) -> None:
            if kind not in SPAN_KINDS:
                return
            what = attrs.get("what") or attrs.get("reason") or attrs.get("method") or ""
            seconds.labels(kind, str(what)).observe(span_seconds)
            if kind in ("train", "rollout") and attrs.get("tokens"):
                tokens.inc(float(attrs["tokens"]))
            # an asynchronous plan's checkpoint is written behind the next step: its bytes are
            # on the `publish` span, not on the short `sync` (the copy) that precedes it
            if kind in ("sync", "publish") and attrs.get("bytes"):
                sync_bytes.inc(float(attrs["bytes"]))

        tracer.observers.append(observe)

    def rpc_errors(self, server) -> None:
        """Error replies of an `RpcServer`, by error code, read from its tally."""
        self.gauge_fn("rpc_errors", "error replies sent, by code (a running total)",
                      lambda: dict(server.errors_by_code), labels=("code",))

    def start(self) -> str | None:
        """Serve /metrics; returns the URL, or None when disabled. A port in use is a
        `ConfigError` naming `logging.metrics.port`."""
        if not self.enabled or self._server is not None:
            return self.url
        host = self.config.host
        try:
            self._server, self._thread = start_http_server(self.port, host, self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError([
                    f"logging.metrics.port: {host}:{self.port} ({self.name}'s /metrics, base "
                    f"port + {PORT_OFFSETS[self.component] + self.index}) is in use; pick another "
                    f"logging.metrics.port or 0 for free ports"]) from None
            raise ConfigError([f"logging.metrics.host: cannot listen on {host}:{self.port}: "
                               f"{exc.strerror or exc}"]) from None
        port = self._server.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}/metrics"
        if self.run_dir is not None:
            folder = self.run_dir / "metrics"
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{self.name}.url.tmp"
            tmp.write_text(self.url + "\n")
            tmp.replace(folder / f"{self.name}.url")
        log.info("metrics.serving", component=self.name, url=self.url)
        return self.url

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is None:
            return
        # prometheus_client's serving loop sees a shutdown only at its next poll (0.5 s): that
        # was up to half a second of every component's stop. The port is released now; the
        # loop (a daemon thread) ends at that poll without anyone waiting for it
        threading.Thread(target=self._server.shutdown, name="metrics-shutdown",
                         daemon=True).start()
        self._server.server_close()
        self._server = self._thread = None


def served_endpoints(run_dir: str | Path) -> list[tuple[str, str]]:
    """(component, URL) of the /metrics endpoints the components of a run dir serve or last
    served, from their run_dir/metrics/NAME.url files."""
    folder = Path(run_dir) / "metrics"
    return [(f.stem, f.read_text().strip()) for f in sorted(folder.glob("*.url"))]
