"""Config: YAML, overrides, env interpolation, presets, and errors that name every bad field."""

from __future__ import annotations

import pytest

from tandem.common.config import PRESETS, load_config
from tandem.common.errors import ConfigError


def test_defaults_validate():
    cfg = load_config()
    assert cfg.explorers[0].name == "explorer-0" and cfg.sync.method == "checkpoint"


def test_yaml_then_overrides_then_env(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text(
        "run_dir: ${env:RUN_ROOT}/r1\n"
        "trainer: {lr: '${env:LR,0.001}'}\n"
        "explorers:\n  - {name: a, batch_size: 2}\n  - {name: b}\n")
    monkeypatch.setenv("RUN_ROOT", "/data")
    cfg = load_config(path, ["explorers.1.batch_size=16", "sync.preset=one_step_off_policy",
                             "explorers.2.name=c"])
    assert cfg.run_dir == "/data/r1" and cfg.trainer.lr == 0.001
    assert [(e.name, e.batch_size) for e in cfg.explorers] == [("a", 2), ("b", 16), ("c", 8)]
    assert (cfg.sync.method, cfg.sync.interval, cfg.sync.offset) == ("nccl", 1, 1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_fill_knobs_and_explicit_keys_win(preset):
    cfg = load_config(None, [f"sync.preset={preset}", "sync.interval=3"])
    expected = {**PRESETS[preset], "interval": 3}
    got = {k: getattr(cfg.sync, k) for k in expected}
    assert got == expected


def test_every_bad_field_is_reported_with_path_and_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["explorers.0.batch_size=0", "trainer.lr=-1", "buffer.polcy=fifo",
                           "sync.method=carrier-pigeon"])
    text = str(err.value)
    assert "explorers[0].batch_size: Input should be greater than or equal to 1 (got 0)" in text
    assert "trainer.lr: Input should be greater than 0 (got -1)" in text
    assert "buffer.polcy: Extra inputs are not permitted" in text
    assert "sync.method: Input should be 'nccl' or 'checkpoint' (got 'carrier-pigeon')" in text
    assert len(err.value.errors) == 4


def test_contradictions_say_how_to_fix():
    with pytest.raises(ConfigError, match="set sync.method: checkpoint or give sync.offset"):
        load_config(None, ["sync.preset=fully_async", "sync.method=nccl"])
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(None, ["explorers.0.name=x", "explorers.1.name=x"])


def test_missing_env_var_and_bad_files(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_dir: ${env:TANDEM_SURELY_UNSET_VAR}\n")
    with pytest.raises(ConfigError, match="run_dir: environment variable TANDEM_SURELY_UNSET_VAR is not set"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)
    path.write_text("a: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["trainer.lr"])


def test_env_values_arrive_as_text_never_as_yaml(tmp_path, monkeypatch):
    import zmq

    path = tmp_path / "run.yaml"
    path.write_text("transport:\n  curve:\n"
                    "    server_public: ${env:T_SP}\n    server_secret: ${env:T_SS}\n"
                    "    client_public: ${env:T_CP}\n    client_secret: ${env:T_CS}\n"
                    "trainer: {lr: '${env:T_LR}'}\n")
    monkeypatch.setenv("T_LR", "3e-4")
    # 400 generated keys: about one in eight holds YAML syntax (a leading `&`, `*`, `!`, `[`,
    # `{`, `@`, `%`, or a `: ` / ` #` inside) and came out changed or as a YAML traceback.
    for _ in range(100):
        keys = {name: zmq.curve_keypair()[i].decode()
                for i, name in enumerate(("T_SP", "T_SS"))}
        keys.update({name: zmq.curve_keypair()[i].decode()
                     for i, name in enumerate(("T_CP", "T_CS"))})
        for name, value in keys.items():
            monkeypatch.setenv(name, value)
        curve = load_config(path).transport.curve
        assert (curve.server_public, curve.server_secret, curve.client_public,
                curve.client_secret) == (keys["T_SP"], keys["T_SS"], keys["T_CP"], keys["T_CS"])
    assert load_config(path).trainer.lr == 3e-4
