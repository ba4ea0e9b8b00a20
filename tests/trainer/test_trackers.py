"""The trainer's trackers (`logging.trackers`): the run's config and each step's metrics reach
TensorBoard, wandb (offline, on disk) and mlflow (a local file store)."""

from __future__ import annotations

import json
import sys

import pytest
from backstop import BACKSTOP

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError
from tandem.trainer.metrics import MetricsWriter

STEPS = [{"loss/total": 0.5, "reward/mean": 0.25}, {"loss/total": 0.25, "reward/mean": 0.75}]


def config(tmp_path, trackers, **logging) -> RunConfig:
    return RunConfig.model_validate({
        "name": "trackers-test", "run_dir": str(tmp_path / "run"), "trainer": {"lr": 3e-4},
        "transport": {"curve": {"server_public": "p" * 40, "server_secret": "s" * 40,
                                "client_public": "q" * 40, "client_secret": "c" * 40}},
        "logging": {"trackers": trackers, **logging}})


def write_steps(cfg: RunConfig) -> MetricsWriter:
    writer = MetricsWriter(cfg.run_path, config=cfg)
    for step, metrics in enumerate(STEPS, start=1):
        writer.write(step, metrics)
    writer.close()
    return writer


def test_tensorboard_gets_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(tmp_path, ["tensorboard"])
    assert write_steps(cfg).trackers == []  # closed
    events = EventAccumulator(str(cfg.run_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]


def test_no_tracker_writes_nothing(tmp_path):
    cfg = config(tmp_path, [])
    write_steps(cfg)
    assert not (cfg.run_path / "tensorboard").exists()


def test_mlflow_run_holds_the_config_and_the_metrics_by_step(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="tandem-trainer[mlflow] not installed")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the writer sets it
    cfg = config(tmp_path, ["mlflow"], project="tandem-tests")
    writer = MetricsWriter(cfg.run_path, config=cfg)
    assert writer.trackers == ["mlflow"]
    for step, metrics in enumerate(STEPS, start=1):
        writer.write(step, metrics)
    run_id = writer._trackers[0].run_id
    writer.close()

    client = mlflow.MlflowClient(tracking_uri=(cfg.run_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "trackers-test"
    assert client.get_experiment(run.info.experiment_id).name == "tandem-tests"
    assert run.data.params["trainer.lr"] == "0.0003"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [
        (1, 0.25), (2, 0.75)]
    stored = json.loads((cfg.run_path / "mlruns").joinpath(
        run.info.experiment_id, run_id, "artifacts", "config.json").read_text())
    assert stored["trainer"]["lr"] == 3e-4
    # no secret leaves the process: the Curve secrets are references to the environment
    assert "s" * 40 not in json.dumps(stored) and "c" * 40 not in str(run.data.params)


def test_wandb_offline_run_holds_the_config_and_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="tandem-trainer[wandb] not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, ["wandb"])
    write_steps(cfg)
    runs = list((cfg.run_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # wandb 0.31 reads its offline log back only through `wandb sync`; the records are
    # uncompressed protobuf, so the config's and the history's strings are in the file
    log = runs[0].read_bytes()
    for text in (b"0.0003", b'"lr"', b"trackers-test", b"reward/mean", b"0.75", b"loss/total"):
        assert text in log, text
    assert b"s" * 40 not in log and b"c" * 40 not in log  # the Curve secrets stayed home


def test_a_tracker_without_its_package_is_a_config_error_naming_the_extra(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"logging.trackers: wandb needs the wandb package; "
                                          r"pip install 'tandem-trainer\[wandb\]'"):
        MetricsWriter(tmp_path, config=config(tmp_path, ["tensorboard", "wandb"]))


def test_a_tracker_named_twice_fails_at_load(tmp_path):
    with pytest.raises(ValueError, match=r"logging.trackers: \['mlflow', 'mlflow'\]"):
        config(tmp_path, ["mlflow", "mlflow"])


def test_eval_rows_reach_the_trackers_against_their_version(tmp_path):
    import asyncio

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "rev 12=", "answer": "21"}) + "\n")
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "logging": {"trackers": ["tensorboard"]},
        "eval": {"tasksets": [{"name": "heldout", "path": str(heldout)}],
                 "final_wait": BACKSTOP}})
    rows = cfg.run_path / "eval.jsonl"
    cfg.run_path.mkdir(parents=True)

    def append(version, accuracy, final=False):
        with open(rows, "a") as f:
            f.write(json.dumps({"version": version, "taskset": "heldout", "final": final,
                                "metrics": {"greedy/accuracy": accuracy}}) + "\n")

    writer = MetricsWriter(cfg.run_path, config=cfg)
    append(0, 0.25)
    writer.write(1, STEPS[0])
    append(2, 0.5)
    writer.write(3, STEPS[1])
    # the end-of-run row arrives while the trainer waits for it at its close: after its first look
    look, looks = writer.write_evals, []

    def look_then_arrive():
        looks.append(look())
        if len(looks) == 1:
            append(3, 0.75, True)
        return looks[-1]

    writer.write_evals = look_then_arrive
    assert asyncio.run(writer.await_final_eval())
    assert len(looks) == 2  # it waited for the row
    writer.close()
    events = EventAccumulator(str(cfg.run_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/heldout/greedy/accuracy")] == [
        (0, 0.25), (2, 0.5), (3, 0.75)]
    # a finished run resumed with more steps: the end-of-run row already in the file closed
    # the earlier segment; a fresh writer passes it on again but does not take it for this
    # segment's, and waits eval.final_wait for that
    cfg.eval.final_wait = 0.2
    writer = MetricsWriter(cfg.run_path, config=cfg)
    writer.write(4, STEPS[1])  # a fresh writer reads the file from its start, the final row too
    assert [row["version"] for row in writer.write_evals()] == []
    assert not asyncio.run(writer.await_final_eval())
    writer.close()
    # this segment's end-of-run row came before the run ended, read by the last step's write:
    # the wait ends at its first look (it once waited the whole eval.final_wait for a newer one)
    writer = MetricsWriter(cfg.run_path, config=cfg)
    append(5, 0.8, True)
    writer.write(5, STEPS[1])
    assert asyncio.run(writer.await_final_eval())
    writer.close()
    # no end-of-run row: the wait ends after eval.final_wait
    rows.write_text("")
    append(0, 0.25)
    writer = MetricsWriter(cfg.run_path, config=cfg)
    assert writer.write_evals()
    assert not asyncio.run(writer.await_final_eval())
    writer.close()
