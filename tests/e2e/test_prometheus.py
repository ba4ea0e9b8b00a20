"""Every component of a `tandem up` run serves Prometheus metrics on /metrics while it runs,
and SIGTERM then stops every process by itself (one run for both: the stop is the end this run
needs anyway)."""

from __future__ import annotations

import re
import signal
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_up_supervision import run_processes, tandem_up, trained_steps, wait_for, write_config
from backstop import BACKSTOP

pytestmark = pytest.mark.slow

COMPONENTS = ("master", "buffer", "trainer", "explorer-0")


DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value, parsed from the text exposition format; a metric declared with
    no sample yet (a labelled counter nobody incremented) maps to nan."""
    with urllib.request.urlopen(url, timeout=BACKSTOP) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out.setdefault(line.split()[2], float("nan"))
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def value(samples: dict[str, float], pattern: str) -> float:
    """The sum of the samples whose `name{labels}` matches `pattern` (0 when none does)."""
    return sum(v for k, v in samples.items() if re.fullmatch(pattern, k))


def test_each_component_serves_its_metrics_and_sigterm_stops_every_process_by_itself(
        tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir, steps=10_000)
    data = yaml.safe_load(cfg.read_text())
    assert "metrics" not in data["logging"]  # `tandem up` serves them, on free ports
    run_dir = tmp_path / "run"
    urls = run_dir / "metrics"
    with tandem_up(cfg) as proc:
        wait_for(lambda: trained_steps(run_dir) >= 1, BACKSTOP, "a trained step")
        assert len(run_processes(run_dir)) == 4
        wait_for(lambda: all((urls / f"{c}.url").exists() for c in COMPONENTS), BACKSTOP,
                 "every component's metrics address")
        got = {c: scrape((urls / f"{c}.url").read_text().strip()) for c in COMPONENTS}
        # the buffer reads its store's counts every 2 s: the first step may have come sooner
        buffer_url = (urls / "buffer.url").read_text().strip()
        def buffer_counts():
            b = scrape(buffer_url)
            return b if value(b, r'tandem_buffer_experiences\{state=".*"\}') >= 8 else None
        got["buffer"] = wait_for(buffer_counts, BACKSTOP, "the buffer's store counts")
        # the trace shows a step trained once it is written; its publication comes after
        trainer_url = (urls / "trainer.url").read_text().strip()
        def trainer_published():
            t = scrape(trainer_url)
            return t if value(t, r'tandem_trainer_span_seconds_count\{kind="sync",.*\}') >= 1 \
                else None
        got["trainer"] = wait_for(trainer_published, BACKSTOP, "the trainer's first publication")
        # a run of 10000 steps is far from its end: SIGTERM stops it mid-run
        proc.send_signal(signal.SIGTERM)
        # bounded only against a hang: past each stage's stop bound (up.stop_timeout,
        # up.trainer_stop_timeout) `tandem up` SIGKILLs it and says so, which fails below
        out, _ = proc.communicate(timeout=BACKSTOP)
        assert proc.returncode == 130, out[-3000:]  # stopped by the signal, steps unfinished
        # every stage stopped on its SIGTERM: none had to be killed (the promptness of a stop
        # is that no component waits out a timeout first, not the seconds this machine took)
        assert "up.stopping" in out and "reason=SIGTERM" in out, out[-3000:]
        assert "up.kill" not in out, out[-3000:]
        assert not run_processes(run_dir)  # `tandem up` reaped each before it exited

    trainer, buffer, master, explorer = (got[c] for c in
                                         ("trainer", "buffer", "master", "explorer-0"))
    assert value(trainer, "tandem_trainer_steps_total") >= 1
    assert value(trainer, r'tandem_trainer_span_seconds_count\{kind="train",what=""\}') >= 1
    assert value(trainer, "tandem_trainer_tokens_per_second") > 0
    assert value(trainer, "tandem_trainer_tokens_total") > 0
    assert "tandem_trainer_staleness_max" in trainer
    assert "tandem_trainer_staleness_token_mean" in trainer
    # fully_async publishes a checkpoint after every step
    assert value(trainer, r'tandem_trainer_span_seconds_count\{kind="sync",.*\}') >= 1
    assert value(trainer, "tandem_trainer_weight_sync_bytes_total") > 0

    assert value(buffer, r'tandem_buffer_put_experiences_total\{outcome="stored"\}') >= 8
    assert value(buffer, "tandem_buffer_samples_total") >= 1
    assert value(buffer, "tandem_buffer_acks_total") >= 1
    assert "tandem_buffer_leases_expired" in buffer
    assert value(buffer, "tandem_buffer_groups_ready") >= 0

    assert value(master, r'tandem_master_clock\{counter="trainer_steps_done"\}') >= 1
    assert "tandem_master_heartbeat_misses_total" in master  # declared, and nobody missed one:
    assert not [k for k in master if k.startswith("tandem_master_heartbeat_misses_total{")]

    assert value(explorer, "tandem_explorer_steps") >= 1
    assert value(explorer, r'tandem_explorer_span_seconds_count\{kind="rollout",.*\}') >= 1
    assert value(explorer, r'tandem_explorer_reward\{function="k12",stat="evaluated"\}') >= 1
    for c in COMPONENTS:  # the closing summary says where each served
        assert (urls / f"{c}.url").read_text().strip() in out, out[-2000:]

    # every metric the documented dashboard plots is served (the reward service did not run)
    served = {key.split("{")[0] for samples in got.values() for key in samples}
    plotted = set(re.findall(r"tandem_[a-z_]+", DASHBOARD.read_text()))
    assert plotted and not {n for n in plotted - served if not n.startswith("tandem_reward_")}


def test_a_metrics_port_in_use_is_a_one_line_error_naming_the_key(tmp_path):
    import socket

    from tandem.common.config import RunConfig
    from tandem.common.errors import ConfigError
    from tandem.common.metrics import MetricsEndpoint

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = RunConfig.model_validate(
            {"logging": {"metrics": {"enabled": True, "port": port - 2}}})
        endpoint = MetricsEndpoint(config.logging.metrics, "trainer", run_dir=Path(tmp_path))
        with pytest.raises(ConfigError, match=rf"logging.metrics.port: 127.0.0.1:{port} "
                                              r"\(trainer's /metrics, base port \+ 2\) is in use"):
            endpoint.start()
