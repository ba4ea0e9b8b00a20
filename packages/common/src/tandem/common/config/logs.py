"""The `logging` section: logs, trace, Prometheus endpoints and experiment trackers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section

# Each component's /metrics port is `logging.metrics.port` plus its offset; explorer i adds i.
PORT_OFFSETS = {"master": 0, "buffer": 1, "trainer": 2, "reward": 3, "explorer": 4}


class MetricsConfig(Section):
    """Prometheus `/metrics` endpoints, one per component process.

    Ports follow from one base: master `port`, buffer `port + 1`, trainer `port + 2`, reward
    service `port + 3`, explorer i `port + 4 + i`. Port 0 lets the system pick a free port for
    each; every component writes the address it serves to run_dir/metrics/NAME.url.
    """

    enabled: bool | None = Field(
        default=None,
        description="serve /metrics; default: on under `tandem up` (free ports unless `port` "
                    "is set), off otherwise")
    host: str = Field(default="127.0.0.1", description="address the endpoints listen on")
    port: int = Field(
        default=9400, ge=0, le=65535,
        description="master's port; buffer +1, trainer +2, reward +3, explorer i +4+i; "
                    "0 = a free port for each (docs/metrics.md)")

    @model_validator(mode="after")
    def _room(self) -> MetricsConfig:
        if self.port and self.port + PORT_OFFSETS["explorer"] > 65535:
            raise ValueError(f"logging.metrics.port: {self.port} leaves no room for the "
                             f"components' ports above it; pick a port below 65500")
        return self


class LoggingConfig(Section):
    """Structured logs: pretty on a terminal, JSON lines in files under the run dir."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    json_console: bool | None = Field(
        default=None, description="JSON lines on stderr; default: only when stderr is not a TTY")
    trace: bool = Field(default=True, description="write timed spans to run_dir/trace")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="where the trainer sends the run's config and step metrics; wandb and "
                    "mlflow need tandem-trainer[wandb] / [mlflow]")
    project: str | None = Field(
        default=None, description="wandb project / mlflow experiment; default: the run's name")

    @model_validator(mode="after")
    def _unique_trackers(self) -> LoggingConfig:
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"logging.trackers: {self.trackers} names one tracker twice")
        return self
