"""The plugin mechanism: one Registry type, plugins by module name or file, names checked when
the config loads, and each bad case a one-line exit 2 naming the key and the plugin."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.common.config import load_config
from tandem.common.errors import ConfigError
from tandem.common.plugins import ENGINES, REWARDS, WORKFLOWS, EngineCapabilities, load_plugins
from tandem.common.registry import PluginError, Registry, plugin_scope, reset_plugin_scope

ROOT = Path(__file__).resolve().parents[2]
TANDEM = Path(sys.executable).parent / "tandem"


def test_a_registry_names_its_key_and_every_registered_item_when_a_name_is_unknown():
    reg: Registry = Registry("widget", "section.widget")
    reg.register("b", object())
    reg.register("a", "json:dumps", fast=True)
    with pytest.raises(ConfigError) as err:
        reg.get("c")
    assert err.value.errors == ["section.widget: unknown widget 'c'; registered: a, b"]
    assert reg.declares("a") == {"fast": True}
    import json

    assert reg.get("a") is json.dumps  # imported on first use


def test_a_name_registered_twice_names_both_plugins():
    reg: Registry = Registry("widget", "section.widget")
    token = plugin_scope("first_plugin")
    reg.register("w", object())
    reset_plugin_scope(token)
    token = plugin_scope("second_plugin")
    try:
        with pytest.raises(PluginError) as err:
            reg.register("w", object())
    finally:
        reset_plugin_scope(token)
    assert "'w' is registered twice, by first_plugin and by second_plugin" in err.value.errors[0]


def test_a_lazy_entry_takes_the_object_its_module_registers_with_its_declarations():
    reg: Registry = Registry("widget", "section.widget")
    reg.register("loads", "json:loads", pure=True)
    import json

    reg.register("loads", json.loads)  # json's own decorator, as tandem's modules do
    assert reg.get("loads") is json.loads and reg.declares("loads") == {"pure": True}
    # and the other way round: the module imported before the lazy entry is registered
    reg.register("dumps", json.dumps)
    reg.register("dumps", "json:dumps", pure=False)
    assert reg.get("dumps") is json.dumps and reg.declares("dumps") == {"pure": False}


def _plugin_file(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_plugin_file_registers_a_reward_workflow_and_engine_the_config_then_accepts(tmp_path):
    plugin = _plugin_file(tmp_path, "plug_ok", """
        from tandem.common.plugins import ENGINES, REWARDS, WORKFLOWS, EngineCapabilities
        REWARDS.register("plug_ok_reward", "tandem.reward.functions.math_answer:MathReward")
        WORKFLOWS.register("plug_ok_flow", "tandem.explorer.workflows.single_turn:SingleTurn",
                           scorer=True)
        ENGINES.register("plug_ok_engine", "tandem.explorer.engines:transformers",
                         capabilities=EngineCapabilities(interrupt=False))
    """)
    config = load_config(None, [f"plugins=[{plugin}]",
                               "reward.functions={plug_ok_reward: 1.0}",
                               "explorers.0.workflow=plug_ok_flow",
                               "explorers.0.workflow_args={reward_fn: plug_ok_reward}",
                               "explorers.0.engine.kind=plug_ok_engine"])
    assert config.plugins == [str(plugin)]
    assert REWARDS.entry("plug_ok_reward").plugin == str(plugin)
    assert WORKFLOWS.declares("plug_ok_flow") == {"scorer": True}
    # the declaration, not the name, decides: this engine does not take mid-step loads
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"plugins=[{plugin}]", "sync.preset=fully_async",
                           "explorers.0.engine.kind=plug_ok_engine",
                           "explorers.0.on_new_weights=interrupt"])
    assert any("on_new_weights: interrupt needs an engine that declares interrupt" in e
               and "not plug_ok_engine" in e for e in err.value.errors)


def test_engine_rules_come_from_declared_capabilities_not_kind_names():
    ENGINES.register("caps_checkpoint_only", "tandem.explorer.engines:transformers",
                     capabilities=EngineCapabilities(weights=frozenset({"checkpoint"})))
    try:
        with pytest.raises(ConfigError) as err:
            load_config(None, ["sync.method=nccl", "explorers.0.engine.kind=caps_checkpoint_only"])
        assert any("sync.method: nccl broadcasts weights, which explorers[explorer-0].engine."
                   "kind: caps_checkpoint_only cannot take" in e for e in err.value.errors)
        with pytest.raises(ConfigError) as err:
            load_config(None, ["explorers.0.engine.kind=caps_checkpoint_only",
                               "explorers.0.engine.tensor_parallel_size=2"])
        assert "does not split a model over devices" in " ".join(err.value.errors)
    finally:
        ENGINES.unregister("caps_checkpoint_only")


def test_a_plugin_that_fails_to_import_is_a_config_error_naming_the_key(tmp_path):
    bad = _plugin_file(tmp_path, "plug_broken", "import no_such_module_anywhere\n")
    with pytest.raises(PluginError) as err:
        load_plugins([str(bad)])
    assert err.value.errors == [f"plugins[0]: plugin {str(bad)!r} failed to import: "
                                "ModuleNotFoundError: No module named 'no_such_module_anywhere'"]


def _tandem_plan(tmp_path: Path, config: str) -> subprocess.CompletedProcess:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(config))
    return subprocess.run([str(TANDEM), "up", str(path)], capture_output=True, text=True,
                          timeout=BACKSTOP, cwd=tmp_path)


@pytest.mark.parametrize("case", ["duplicate", "broken", "unknown_reward"])
def test_bad_plugins_and_unknown_names_exit_2_with_one_line_before_anything_starts(
        tmp_path, case):
    _plugin_file(tmp_path, "dup_reward", """
        from tandem.reward import PureReward, register
        @register("math")
        class MyMath(PureReward):
            pass
    """)
    _plugin_file(tmp_path, "broken_plugin", "raise RuntimeError('boom at import')\n")
    plugins = {"duplicate": "[dup_reward.py]", "broken": "[broken_plugin.py]",
               "unknown_reward": "[]"}[case]
    out = _tandem_plan(tmp_path, f"""
        run_dir: {tmp_path / 'run'}
        plugins: {plugins}
        explorers:
          - name: explorer-0
            workflow_args: {{reward_fn: my_reward}}
    """)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    expected = {
        "duplicate": ["plugins[0]", "dup_reward.py", "reward function 'math' is registered "
                      "twice, by reward (tandem.reward.builtins"],
        "broken": ["plugins[0]", "broken_plugin.py", "RuntimeError: boom at import"],
        "unknown_reward": ["explorers[explorer-0].workflow_args.reward_fn: unknown reward "
                           "function 'my_reward'; registered: code, format"],
    }[case]
    for part in expected:
        assert part in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # refused before any component started
