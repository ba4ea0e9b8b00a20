"""The `weights` config section: defaults, limits, and a rendezvous host explorers can reach."""

from __future__ import annotations

import pytest

from tandem.common.config import load_config
from tandem.common.errors import ConfigError
from tandem.weights import WeightBroadcaster, WeightPublisher, WeightsError


def test_defaults_follow_the_design():
    weights = load_config(None).weights
    assert weights.bucket_bytes == 512 * 2**20 and weights.keep_versions == 3
    assert weights.backend == "auto" and weights.verify_checksums


def test_bad_values_are_reported_by_path():
    with pytest.raises(ConfigError) as failure:
        load_config(None, ["weights.rendezvous_host=0.0.0.0", "weights.keep_versions=0",
                           "weights.backend=mpi"])
    text = str(failure.value)
    assert "weights.rendezvous_host" in text and "listen-on-all" in text
    assert "weights.keep_versions" in text and "weights.backend" in text


def test_components_build_from_the_config(tmp_path):
    config = load_config(None, ["sync.timeout=7", "weights.bucket_bytes=65536",
                                "weights.keep_versions=2"])
    broadcaster = WeightBroadcaster.from_config(config)
    try:
        assert (broadcaster.timeout, broadcaster.bucket_bytes, broadcaster.port > 0) == (
            7.0, 65536, True)
    finally:
        broadcaster.close()
    publisher = WeightPublisher.from_config(tmp_path, config.weights)
    assert publisher.keep == 2


def test_a_taken_rendezvous_port_names_the_keys():
    first = WeightBroadcaster(timeout=5.0)
    try:
        with pytest.raises(WeightsError, match=f"127.0.0.1:{first.port} .*rendezvous_port"):
            WeightBroadcaster(port=first.port, timeout=5.0)
    finally:
        first.close()
