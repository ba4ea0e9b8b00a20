"""`RemoteEngine` against two OpenAI-compatible servers: a tandem explorer's endpoint over a
`TransformersEngine` (in `make test`), and vLLM's own `vllm serve` started as a process (marked
`vllm`, in `make test-vllm`). Both are driven through the same `/v1/completions` fields."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from backstop import BACKSTOP
from tandem.common.config import EngineConfig, ModelConfig, RunConfig
from tandem.common.config.explorer import OpenAIConfig
from tandem.common.config.transport import move_secrets_to_env
from tandem.explorer.engines import create_engine
from tandem.explorer.openai_server import OpenAIEndpoint
from tandem.explorer.remote_engine import RemoteEngine, RemoteEngineError
from tandem.explorer.sampling import SamplingParams, policy_logprobs
from tandem.explorer.weights import WeightLoader
from tandem.weights import WeightPublisher
from tandem.common.sockets import free_port

PROMPTS = ["1+2=", "What is 7*6? ", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


async def connect(url: str, model_path, **kwargs) -> RemoteEngine:
    # blocking checks, off the loop that serves the endpoint
    return await asyncio.to_thread(RemoteEngine.connect, url, str(model_path), **kwargs)


class Serving:
    """A tandem endpoint over `engine` for the length of an `async with`."""

    def __init__(self, engine, **config):
        self.endpoint = OpenAIEndpoint(OpenAIConfig(**config), engine, sampling=GREEDY,
                                       context=512)

    async def __aenter__(self) -> str:
        return await self.endpoint.start()

    async def __aexit__(self, *exc) -> None:
        await self.endpoint.close()


async def test_token_ids_and_logprobs_equal_the_engines_own(engine, tiny_model_path):
    async with Serving(engine) as url:
        remote = await connect(url, tiny_model_path, served_model="policy")
        try:
            assert remote.model == "policy" and remote.max_model_len == 512
            got = await remote.generate(PROMPTS, 2, GREEDY)
            want = engine.generate_sync(PROMPTS, 1, GREEDY)
            for prompt, group, [own] in zip(PROMPTS, got, want):
                assert len(group) == 2
                for c in group:
                    assert c.prompt_ids.tolist() == engine.tokenizer(prompt).input_ids
                    assert c.token_ids.tolist() == own.token_ids.tolist()
                    np.testing.assert_allclose(c.logprobs, own.logprobs, atol=1e-5)
                    assert (c.text, c.finish_reason) == (own.text, own.finish_reason)
            # seeded sampling: prompt i is seeded seed + i*n, its n samples one stream
            sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7)
            got = await remote.generate(PROMPTS, 3, sampled)
            for i, (prompt, group) in enumerate(zip(PROMPTS, got)):
                own = engine.generate_sync([prompt] * 3, 1, SamplingParams(
                    temperature=1.0, top_p=0.9, max_tokens=10, seed=7 + 3 * i))
                assert [c.token_ids.tolist() for c in group] == [
                    o.token_ids.tolist() for [o] in own]
                for c, [o] in zip(group, own):
                    np.testing.assert_allclose(c.logprobs, o.logprobs, atol=1e-5)
            assert len({tuple(c.token_ids.tolist()) for g in got for c in g}) > 1
        finally:
            remote.close()


async def test_stop_strings_are_kept_and_named(engine, tiny_model_path):
    async with Serving(engine) as url:
        remote = await connect(url, tiny_model_path)
        try:
            free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            [[whole]] = await remote.generate(["1+2="], 1, free)
            assert whole.finish_reason == "length" and len(whole) == 10
            stop = whole.text[3:5]
            [[cut]] = await remote.generate(["1+2="], 1, SamplingParams(
                temperature=0.0, max_tokens=10, stop=(stop, "@@@"), ignore_eos=True))
            [[own]] = engine.generate_sync(["1+2="], 1, SamplingParams(
                temperature=0.0, max_tokens=10, stop=(stop, "@@@"), ignore_eos=True))
            assert (cut.finish_reason, cut.stop) == ("stop", stop) == (own.finish_reason, own.stop)
            assert cut.text == own.text and cut.text.endswith(stop)
            assert cut.token_ids.tolist() == whole.token_ids[:len(cut)].tolist()
        finally:
            remote.close()


async def test_a_server_without_the_reload_route_fails_the_load_naming_it(
        engine, tiny_model_path, tmp_path):
    WeightPublisher(tmp_path).publish(
        1, [(n, p.detach().clone()) for n, p in engine.model.named_parameters()])
    async with Serving(engine) as url:
        remote = await connect(url, tiny_model_path)
        loader = WeightLoader(remote, run_dir=tmp_path, explorer="explorer-0", timeout=BACKSTOP)
        try:
            with pytest.raises(RemoteEngineError) as err:
                await loader.load(1, "checkpoint")
            message = str(err.value)
            assert "engine.url" in message and "POST /collective_rpc answered 404" in message
            assert "VLLM_SERVER_DEV_MODE=1" in message and "\n" not in message
            assert remote.version == 0
            with pytest.raises(RemoteEngineError, match="sync.method: nccl"):
                await remote.fetch_broadcast(1)
            # a failed load holds nothing back: generation goes on
            [[c]] = await remote.generate(["1+2="], 1, GREEDY)
            assert len(c) > 0
        finally:
            await loader.close()
            remote.close()


def test_an_unreachable_server_is_one_line_naming_engine_url(tiny_model_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    config = EngineConfig(kind="remote", url=url, request_timeout=BACKSTOP)
    with pytest.raises(RemoteEngineError) as err:
        create_engine(config, ModelConfig(path=str(tiny_model_path)))
    assert str(err.value).startswith(f"engine.url {url}: cannot reach the server")
    assert "\n" not in str(err.value)


def test_the_explorer_exits_1_in_one_line_when_its_server_is_unreachable(tmp_path,
                                                                         tiny_model_path):
    from click.testing import CliRunner

    from tandem.explorer.cli import main

    url = f"http://127.0.0.1:{free_port()}/v1"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run_dir: {tmp_path / 'run'}\nmaster: {{total_steps: 1}}\nlogging: {{trace: false}}\n"
        f"model: {{path: {tiny_model_path}}}\nsync: {{method: checkpoint}}\n"
        f"explorers: [{{name: explorer-0, engine: {{kind: remote, url: '{url}'}}}}]\n")
    result = CliRunner().invoke(main, ["--config", str(config), "--name", "explorer-0"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]  # earlier lines are the explorer's log
    assert f"engine.url {url}: cannot reach the server" in last
    assert "Traceback" not in result.output


def bare_server() -> FastAPI:
    """An OpenAI-compatible server of the plainest kind: text out, no ids, no logprobs."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain", "object": "model", "created": 0,
                                            "owned_by": "someone"}]}

    @app.post("/v1/completions")
    async def completions():
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "plain",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length",
                             "logprobs": None}]}

    return app


async def test_a_server_without_token_ids_or_logprobs_is_refused_naming_what_is_missing(
        tiny_model_path):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(bare_server(), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(RemoteEngineError) as err:
            await connect(url, tiny_model_path)
        assert str(err.value).startswith(f"engine.url {url}: the server returned no token ids")
        with pytest.raises(RemoteEngineError, match="engine.served_model: the server at .* "
                                                    "serves \\['plain'\\]; not 'policy'"):
            await connect(url, tiny_model_path, served_model="policy")
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, BACKSTOP)


def test_config_remote_needs_a_url_refuses_nccl_and_keeps_the_key_off_disk():
    with pytest.raises(ValueError, match="engine.url: engine.kind: remote needs"):
        EngineConfig(kind="remote")
    explorer = {"name": "e0", "engine": {"kind": "remote", "url": "http://gpu:8000/v1",
                                         "api_key": "sk-secret"}}
    with pytest.raises(ValueError, match=r"sync.method: nccl broadcasts weights, which "
                                         r"explorers\[e0\].engine.kind: remote cannot take"):
        RunConfig(sync={"method": "nccl"}, explorers=[explorer])
    config = RunConfig(sync={"method": "checkpoint"}, explorers=[explorer])
    data = config.model_dump(mode="json")
    env = move_secrets_to_env(data)
    assert env == {"TANDEM_ENGINE_API_KEY_0": "sk-secret"}
    assert data["explorers"][0]["engine"]["api_key"] == "${env:TANDEM_ENGINE_API_KEY_0}"
    assert "sk-secret" not in repr(data)


# -- vLLM's own server (make test-vllm) ---------------------------------------------------------


def teacher_forced(model, completion, params):
    ids = torch.tensor(list(completion.prompt_ids) + list(completion.token_ids))[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    p = len(completion.prompt_ids)
    return policy_logprobs(logits[p - 1:-1], params).gather(-1, ids[0, p:, None]).squeeze(-1)


def worst_gap(model, groups, params) -> float:
    return max((teacher_forced(model, c, params) - torch.from_numpy(c.logprobs)).abs().max().item()
               for g in groups for c in g)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """`vllm serve` on a tiny model as a process group of its own, dev routes on and tandem's
    worker extension installed; the whole group is killed at the end."""
    pytest.importorskip("vllm")
    from tandem.explorer.vllm_worker import EXTENSION
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("remote-model")
    # vLLM's CPU attention needs head_dim >= 32; untied, since vLLM's own reload leaves a tied
    # head stale on its CPU backend (reload: tandem re-ties it)
    model, _ = build_tiny_model(path, hidden=128, heads=2, kv_heads=1, tie_embeddings=False)
    port = free_port()
    log_path = path.parent / "vllm-serve.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
         "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
         "--kv-cache-memory-bytes", str(128 << 20), "--block-size", "32",
         "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        deadline = time.monotonic() + BACKSTOP
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"vllm serve did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1", path, model.eval()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        try:  # whatever of the group outlived its leader
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
        seed + i)) for i, (n, p) in enumerate(model.named_parameters())}


def gap_under(model, weights, groups, params) -> float:
    """`worst_gap` with `weights` in the model for the length of the call."""
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    try:
        return worst_gap(model, groups, params)
    finally:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(original[name])


@pytest.mark.vllm
async def test_vllm_serve_generates_and_reloads_checkpoint_versions(vllm_server, tmp_path):
    url, path, model = vllm_server
    remote = await connect(url, path, served_model="policy")
    loader = WeightLoader(remote, run_dir=tmp_path, explorer="explorer-0", timeout=BACKSTOP)
    try:
        sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=3)
        groups = await remote.generate(PROMPTS, 2, sampled)
        assert [len(g) for g in groups] == [2, 2, 2]
        assert worst_gap(model, groups, sampled) < 2e-3
        assert [c.token_ids.tolist() for g in groups for c in g] == [
            c.token_ids.tolist() for g in await remote.generate(PROMPTS, 2, sampled) for c in g]
        before = await remote.generate(PROMPTS, 1, GREEDY)
        assert worst_gap(model, before, GREEDY) < 2e-3

        publisher = WeightPublisher(tmp_path)
        for version, reload in ((1, "vllm"), (2, "tandem")):
            weights = perturbed(model, 100 * version)
            publisher.publish(version, weights.items())
            remote.reload = reload
            stats = await loader.load(version, "checkpoint")
            assert remote.version == version and stats["tensors"] == len(weights)
            after = await remote.generate(PROMPTS, 1, GREEDY)
            assert max(abs(a[0].logprobs[0] - b[0].logprobs[0])
                       for a, b in zip(after, before)) > 1e-3
            # the server samples the new weights, its prefix cache included
            assert gap_under(model, weights, after, GREEDY) < 2e-3, reload
            before = after
    finally:
        await loader.close()
        remote.close()
