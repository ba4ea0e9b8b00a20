"""`placement.colocate` rules (pure logic, no processes): what is accepted, where the colocated
explorer's devices come from, and each refusal naming the key to change."""

from __future__ import annotations

import pytest

from tandem.common.config import RunConfig
from tandem.common.config.placement import colocated_explorer, resolve_placement
from tandem.common.errors import ConfigError


def colocated(**override) -> dict:
    return {"name": "c", "run_dir": "/tmp/tandem-colocate-config", "model": {"path": "/m"},
            "sync": {"preset": "synchronous", "method": "checkpoint"},
            "weights": {"transport": "shared_memory"},
            "explorers": [{"name": "explorer-0"}],
            "placement": {"colocate": ["trainer", "explorer-0"], "trainer": {"devices": "0"},
                          "cores": 4},
            **override}


def test_colocated_explorer_takes_the_trainers_devices_and_every_core():
    config = RunConfig.model_validate(colocated())
    assert colocated_explorer(config) == "explorer-0"
    table = resolve_placement(config)
    assert table["explorer-0"].devices == table["trainer"].devices == "0"
    assert table["explorer-0"].threads == table["trainer"].threads == 4  # they alternate
    # memory freed between phases goes back to the system (measured: docs/benchmarks.md)
    assert table["trainer"].env()["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert table["explorer-0"].env()["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert "MALLOC_MMAP_THRESHOLD_" not in table["buffer"].env()


def test_no_colocation_by_default():
    config = RunConfig.model_validate(colocated(placement={}))
    assert colocated_explorer(config) is None


@pytest.mark.parametrize("override,says", [
    ({"placement": {"colocate": ["explorer-0"]}}, "must name the trainer and one explorer"),
    ({"placement": {"colocate": ["trainer", "explorer-7"]}}, "no explorer named 'explorer-7'"),
    ({"sync": {"preset": "fully_async"}}, "offset null (asynchronous)"),
    ({"sync": {"method": "checkpoint", "interval": 2, "offset": 0}}, "sync.interval: 1"),
    ({"weights": {"transport": "shared_fs"}}, "weights.transport: shared_memory"),
    ({"explorers": [{"name": "explorer-0"}, {"name": "explorer-1"}]},
     "colocated runs take one rollout explorer"),
    ({"placement": {"colocate": ["trainer", "explorer-0"], "explorers": {"devices": "1"}}},
     "a colocated explorer takes the trainer's"),
    ({"explorers": [{"name": "explorer-0", "engine": {"kind": "remote",
                                                      "url": "http://h:8000/v1"}}],
      "weights": {"transport": "fetch"}}, "cannot sleep"),
])
def test_colocation_refused_where_it_cannot_work(override, says):
    with pytest.raises((ValueError, ConfigError)) as exc:
        RunConfig.model_validate(colocated(**override))
    assert says in str(exc.value)
