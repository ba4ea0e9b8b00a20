"""Step metrics: accumulated over micro-batches and ranks, sent to the run's trackers
(TensorBoard, wandb, mlflow) and to the trainer's Prometheus endpoint.

Reduction by name: `loss/*` terms are already divided by the whole step's denominators and
are summed; names ending in `_max` / `_min` take the max / min; everything else is a mean
weighted by each micro-batch's action tokens.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import Tensor

from tandem.common.config import RunConfig
from tandem.common.config.transport import move_secrets_to_env
from tandem.common.errors import ConfigError
from tandem.common.metrics import MetricsEndpoint
from tandem.common.trace import Tracer

log = structlog.get_logger(__name__)


def _kind(name: str) -> str:
    if name.startswith("loss/"):
        return "sum"
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


class MetricAccumulator:
    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}

    def add(self, metrics: dict[str, Tensor | float], weight: float) -> None:
        for name, value in metrics.items():
            v = float(value.detach()) if isinstance(value, Tensor) else float(value)
            slot = self._values.setdefault(name, [0.0, 0.0])
            kind = _kind(name)
            if kind == "sum":
                slot[0] += v
            elif kind == "max":
                slot[0] = v if slot[1] == 0 else max(slot[0], v)
                slot[1] = 1.0
            elif kind == "min":
                slot[0] = v if slot[1] == 0 else min(slot[0], v)
                slot[1] = 1.0
            else:
                slot[0] += v * weight
                slot[1] += weight

    def result(self, group_size: int = 1) -> dict[str, float]:
        """Final values; with several ranks every rank must call it (a collective)."""
        names = sorted(self._values)
        if group_size > 1:
            names = _common_names(names)
            for kind, op in (("sum", dist.ReduceOp.SUM), ("mean", dist.ReduceOp.SUM),
                             ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                picked = [n for n in names if _kind(n) == kind]
                if not picked:
                    continue
                buf = torch.tensor([self._values.get(n, [0.0, 0.0]) for n in picked],
                                   dtype=torch.float64)
                if kind in ("max", "min"):  # ranks without a value must not win
                    fill = -torch.inf if kind == "max" else torch.inf
                    buf[:, 0] = torch.where(buf[:, 1] > 0, buf[:, 0],
                                            torch.full_like(buf[:, 0], fill))
                dist.all_reduce(buf, op=op)
                for n, row in zip(picked, buf.tolist()):
                    self._values[n] = row
        out = {}
        for name in names:
            total, weight = self._values[name]
            kind = _kind(name)
            out[name] = total / weight if kind == "mean" and weight > 0 else total
        return out


def combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its optimiser updates (PPO epochs x mini-batches).

    Each name takes its mean over the updates (`_max` / `_min` names their max / min); with
    more than one update, `NAME/last` also holds the last update's value, the one that shows
    how far the inner loop moved the policy from the batch's clip anchor.
    """
    if len(updates) == 1:
        return dict(updates[0])
    out: dict[str, float] = {}
    for name in sorted({n for u in updates for n in u}):
        values = [u[name] for u in updates if name in u]
        kind = _kind(name)
        if kind == "max":
            out[name] = max(values)
        elif kind == "min":
            out[name] = min(values)
        else:
            out[name] = sum(values) / len(values)
        if name in updates[-1]:
            out[f"{name}/last"] = updates[-1][name]
    return out


def _common_names(names: list[str]) -> list[str]:
    """The union of every rank's metric names, gathered as UTF-8 bytes (no pickling)."""
    data = torch.frombuffer(bytearray("\n".join(names).encode() or b"\n"), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded)
    union = set()
    for part, size in zip(parts, sizes):
        union.update(n for n in bytes(part[: int(size)].tolist()).decode().split("\n") if n)
    return sorted(union)


class MetricsWriter:
    """Where a step's metrics go: the run's trackers (`logging.trackers`: TensorBoard under
    run_dir/tensorboard, wandb, mlflow), each told the run's config first, and, with a `config`,
    the trainer's Prometheus endpoint (`logging.metrics`): steps, step and sync seconds from the
    `tracer`'s spans, tokens, staleness, reward. Without a `run_dir` (ranks > 0) it does nothing.

    Evaluation results reach the trackers here too: an explorer writes them to
    run_dir/eval.jsonl, and each `write` passes on the rows that appeared since, as
    `eval/<taskset>/<mode>/<metric>` against the version evaluated (`await_final_eval` waits at
    the end of the run for the explorer's last evaluation).
    """

    def __init__(self, run_dir: str | Path | None, enabled: bool = True, *,
                 config: RunConfig | None = None, tracer: Tracer | None = None):
        self._trackers: list[_Tracker] = []
        self.endpoint: MetricsEndpoint | None = None
        self._evals: EvalRows | None = None
        self._final_wait = 0.0
        if run_dir is None:
            return
        run_dir = Path(run_dir)
        if config is not None and config.eval.enabled:
            self._evals = EvalRows(run_dir / "eval.jsonl")
            self._final_wait = config.eval.final_wait if config.eval.at_end else 0.0
        trackers = config.logging.trackers if config is not None else ["tensorboard"]
        params = _public_config(config) if config is not None else {}
        try:
            if enabled and "tensorboard" in trackers:
                self._trackers.append(_TensorBoard(run_dir))
            if "wandb" in trackers:
                self._trackers.append(_Wandb(config, run_dir, params))
            if "mlflow" in trackers:
                self._trackers.append(_Mlflow(config, run_dir, params))
            if config is not None:
                self.endpoint = m = MetricsEndpoint(config.logging.metrics, "trainer",
                                                    run_dir=run_dir)
                self._steps = m.counter("steps", "trainer steps taken")
                self._updates = m.counter("updates",
                                          "optimiser updates (PPO epochs x mini-batches)")
                self._gauges = {name: m.gauge(metric, doc) for name, metric, doc in STEP_GAUGES}
                if tracer is not None:
                    m.observe_spans(tracer)
                m.start()
        except BaseException:
            self.close()
            raise

    @property
    def trackers(self) -> list[str]:
        return [t.name for t in self._trackers]

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.endpoint is not None:
            self._steps.inc()
            self._updates.inc(metrics.get("train/updates", 1.0))
            for name, gauge in self._gauges.items():
                if name in metrics:
                    gauge.set(metrics[name])
        for tracker in self._trackers:
            tracker.write(step, metrics)
        self.write_evals()

    def write_evals(self) -> list[dict]:
        """Pass the eval rows that appeared since the last call to the trackers."""
        rows = self._evals.read() if self._evals is not None else []
        for row in rows:
            metrics = {f"eval/{row['taskset']}/{k}": float(v) for k, v in row["metrics"].items()}
            for tracker in self._trackers:
                tracker.write_eval(int(row.get("version") or 0), metrics)
        return rows

    async def await_final_eval(self) -> bool:
        """The run is over: wait up to `eval.final_wait` for the explorer's end-of-run rows
        (`final`), passing on what arrives; False (and a warning) if they never come. A row
        the last step's `write` already passed on counts (the wait is for a row, not for a
        new one); a row that was in eval.jsonl before this process started does not."""
        if self._evals is None or self._final_wait <= 0:
            return True
        import asyncio

        deadline = time.monotonic() + self._final_wait
        while True:
            self.write_evals()
            if self._evals.final_since_start:
                return True
            if time.monotonic() >= deadline:
                log.warning("trainer.eval_missing", waited=self._final_wait,
                            hint="the evaluating explorer wrote no end-of-run row to "
                                 "eval.jsonl; raise eval.final_wait if it is only slow")
                return False
            await asyncio.sleep(0.2)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def _public_config(config: RunConfig) -> dict:
    """The run's config as trackers get it: JSON values, Curve secrets replaced by references."""
    data = config.model_dump(mode="json")
    move_secrets_to_env(data)
    return data


def _flatten(data: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


class EvalRows:
    """The rows run_dir/eval.jsonl gained since the last `read` (whole lines only), all of them
    from the file's start. `final_since_start`: whether an end-of-run row (`final`) was
    appended after this reader was made; one already there closed an earlier segment of the
    run (a finished run resumed with more steps), not this one."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        try:
            self.start = path.stat().st_size
        except OSError:
            self.start = 0
        self.final_since_start = False

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        at, self.offset = self.offset, self.offset + end
        rows = []
        for line in chunk[:end].splitlines(keepends=True):
            at += len(line)
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("metrics"), dict):
                rows.append(row)
                if row.get("final") and at > self.start:
                    self.final_since_start = True
        return rows


class _Tracker:
    name = ""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def write_eval(self, version: int, metrics: dict[str, float]) -> None:
        """Eval results, against the weights version they measured."""
        self.write(version, metrics)

    def close(self) -> None:
        raise NotImplementedError


def _need(package: str, tracker: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError([f"logging.trackers: {tracker} needs the {package} package; "
                           f"pip install 'tandem-trainer[{tracker}]'"]) from None


class _TensorBoard(_Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb(_Tracker):
    """A wandb run under run_dir/wandb; `WANDB_MODE=offline` keeps it on disk."""

    name = "wandb"

    def __init__(self, config: RunConfig, run_dir: Path, params: dict):
        wandb = _need("wandb", "wandb")
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(project=config.logging.project or config.name, name=config.name,
                               dir=str(run_dir), config=params)
        self._eval_axis = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def write_eval(self, version: int, metrics: dict[str, float]) -> None:
        # wandb's own step only grows, and an evaluation lands after the step that follows
        # its version: eval/* is plotted against its own axis, eval/version
        if not self._eval_axis:
            self._run.define_metric("eval/version")
            self._run.define_metric("eval/*", step_metric="eval/version")
            self._eval_axis = True
        self._run.log({**metrics, "eval/version": version})

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()  # its service process ends with the trainer's tracking


class _Mlflow(_Tracker):
    """An mlflow run: the config as params (flattened keys) and as config.json, metrics by
    step. The tracking URI is MLFLOW_TRACKING_URI (a server, a database), or else a file store
    in run_dir/mlruns: no server and no database, the one mlflow-skinny can write alone (mlflow
    3 keeps it in maintenance and asks for MLFLOW_ALLOW_FILE_STORE, set here for that case)."""

    name = "mlflow"
    BATCH = 100  # params per log_batch call (mlflow's limit)

    def __init__(self, config: RunConfig, run_dir: Path, params: dict):
        mlflow = _need("mlflow", "mlflow")
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = config.logging.project or config.name
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=config.name).info.run_id
        flat = [Param(k, v[:6000]) for k, v in _flatten(params).items()]
        for i in range(0, len(flat), self.BATCH):
            self.client.log_batch(self.run_id, params=flat[i:i + self.BATCH])
        self.client.log_dict(self.run_id, params, "config.json")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()
                 if math.isfinite(float(v))]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# step metric -> (Prometheus gauge, its help) on the trainer's endpoint
STEP_GAUGES = [
    ("throughput/tokens_per_s", "tokens_per_second", "tokens per second of the last step"),
    ("time/step_s", "step_seconds_last", "seconds of the last step"),
    ("staleness/mean", "staleness_mean", "mean policy-version lag of the last step's batch"),
    ("staleness/max", "staleness_max", "largest policy-version lag in the last step's batch"),
    ("staleness/token_mean", "staleness_token_mean",
     "mean version lag of the last step's action tokens, each at the version that sampled it"),
    ("reward/mean", "reward_mean", "mean reward of the last step's batch"),
    ("loss/total", "loss", "total loss of the last step"),
    ("optim/grad_norm", "grad_norm", "gradient norm of the last step (mean over updates)"),
    ("policy/clip_frac", "clip_frac", "clipped token fraction of the last step"),
    ("mismatch/kl", "mismatch_kl", "KL(engine || trainer) of the last step's sampled tokens (k3)"),
    ("mismatch/ratio_max", "mismatch_ratio_max",
     "largest trainer/engine importance ratio of the last step's tokens"),
]
