"""VLLMEngine's bad input: each ends in one line naming the config key, and no vLLM process
outlives it. The engine's contract (logprobs, stops, n, seeds, weight loads) is in
test_engine_contract.py. Tests marked `vllm` run against real vLLM (`make test-vllm`)."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from backstop import BACKSTOP
from processes import vllm_processes

from tandem.explorer.cli import main
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.weights import WeightLoader
from tandem.weights import WeightPublisher


def run_explorer(tmp_path, model_path, *options: str):
    """`tandem-explorer` (in this process) with `engine.kind: vllm`; returns the click result."""
    config = tmp_path / "run.yaml"
    engine = ", ".join(["kind: vllm", "options: {enforce_eager: true, max_model_len: 64, "
                        "kv_cache_memory_bytes: 67108864}", *options])
    config.write_text(f"run_dir: {tmp_path / 'run'}\nmaster: {{total_steps: 1}}\n"
                      f"model: {{path: {model_path}, dtype: float32}}\nlogging: {{trace: false}}\n"
                      f"explorers: [{{name: explorer-0, engine: {{{engine}}}}}]\n")
    return CliRunner().invoke(main, ["--config", str(config), "--name", "explorer-0"])


def test_without_vllm_the_explorer_exits_1_naming_engine_kind(tmp_path, tiny_model_path,
                                                               monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if not installed
    result = run_explorer(tmp_path, tiny_model_path)
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]  # earlier lines are the explorer's log
    assert "engine.kind: vllm needs vLLM installed" in last
    assert "Traceback" not in result.output


@pytest.mark.vllm
def test_a_model_vllm_cannot_load_exits_1_naming_model_path_and_leaves_no_process(
        tmp_path, tiny_model_path):
    pytest.importorskip("vllm")
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_model_path.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = run_explorer(tmp_path, model)
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert "model.path" in last and "NoSuchModelForCausalLM" in last
    assert "Traceback" not in result.output
    assert vllm_processes() == []


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from tandem.explorer.vllm_engine import VLLMEngine
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("vllm-model")
    build_tiny_model(path, hidden=128, heads=2, kv_heads=1)  # vLLM's CPU attention: head_dim 64
    engine = VLLMEngine.from_pretrained(path, dtype="float32", max_model_len=32,
                                        enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    yield engine
    engine.close()
    assert vllm_processes() == []


@pytest.mark.vllm
async def test_a_prompt_over_max_model_len_names_the_option(vllm_engine):
    with pytest.raises(ValueError, match=r"engine\.options\.max_model_len: prompt 1 has 40"):
        await vllm_engine.generate(["hi", "x" * 40], 1, SamplingParams(max_tokens=4))
    # the engine still serves, and a response stops at max_model_len
    [[c]] = await vllm_engine.generate(["x" * 28], 1, SamplingParams(max_tokens=16,
                                                                      ignore_eos=True))
    assert c.finish_reason == "length" and len(c) == 32 - 28


@pytest.mark.vllm
async def test_a_weight_the_model_lacks_is_refused_by_name(vllm_engine, tmp_path):
    import torch

    WeightPublisher(tmp_path).publish(1, [("model.no_such_layer.weight", torch.zeros(2, 2))])
    loader = WeightLoader(vllm_engine, run_dir=tmp_path, explorer="explorer-0",
                          timeout=BACKSTOP)
    try:
        with pytest.raises(ValueError, match="weights: vLLM refused 'model.no_such_layer.weight'"):
            await loader.load(1, "checkpoint")
    finally:
        await loader.close()
    assert vllm_engine.version == 0
    [[c]] = await vllm_engine.generate(["1+2="], 1, SamplingParams(max_tokens=4))
    assert len(c) >= 1  # the engine survived the refused load
