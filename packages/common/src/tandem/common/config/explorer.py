"""The `explorers` section: one entry per explorer, each with its engine, sampling and workflow."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Section
from .registered import check_engine


class SamplingConfig(Section):
    """How responses are sampled. Behaviour logprobs are taken under exactly this policy:
    `log_softmax` of logits / temperature after top-k then top-p truncation (docs/explorer.md)."""

    temperature: float = Field(
        default=1.0, ge=0, description="0 is greedy (logprobs then under the unscaled logits)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus mass kept; 1 disables")
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    max_tokens: int = Field(default=64, ge=1, description="tokens per response (per model turn)")
    stop: list[str] = Field(default_factory=list, description="strings that end a response")
    seed: int | None = Field(
        default=None, description="fixes the sampling stream of every call; null: seeded per call")

    @model_validator(mode="after")
    def _stops_not_empty(self) -> SamplingConfig:
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop: an empty string would end every response at once; "
                             "remove it")
        return self


class EngineConfig(Section):
    """The inference engine."""

    kind: str = Field(
        default="transformers",
        description="a registered engine (`tandem plugins` lists them): transformers: the "
                    "embedded engine (CPU or CUDA); vllm: vLLM's AsyncLLM; remote: an "
                    "OpenAI-compatible server elsewhere (`vllm serve`), at engine.url; or a "
                    "plugin's (docs/extending.md)")
    device: str = Field(default="cpu", description="cpu, cuda, cuda:1 ... (transformers only)")
    max_batch: int = Field(
        default=64, ge=1, description="sequences generated at once (vllm: max_num_seqs)")
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vllm: devices one engine's model is split over")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="engine-specific arguments (transformers: seed, attn_implementation, "
                    "threads: torch intra-op threads of the process; vllm: seed and any "
                    "AsyncEngineArgs field, e.g. max_model_len, enforce_eager)")

    url: str | None = Field(
        default=None,
        description="remote: the server's base URL, e.g. http://gpu-host:8000/v1")
    api_key: str | None = Field(
        default=None,
        description="remote: the server's API key; write ${env:VAR} (tandem up hands it to the "
                    "explorer through its environment, never through a file)")
    served_model: str | None = Field(
        default=None, description="remote: the model name the server serves (its --served-model-"
                                  "name); null: the one model the server lists")
    reload: Literal["vllm", "tandem"] = Field(
        default="vllm",
        description="remote: the server's worker method that reloads weights/v{N} (vLLM dev "
                    "routes, VLLM_SERVER_DEV_MODE=1): vllm = vLLM's reload_weights; tandem = "
                    "tandem's worker extension (--worker-extension-cls tandem.explorer."
                    "vllm_worker.TandemWeightExtension), which also re-ties a tied lm_head")
    request_timeout: float = Field(
        default=600.0, gt=0, description="remote: seconds one request to the server may take")
    max_concurrency: int = Field(
        default=64, ge=1, description="remote: requests in flight to the server at once")

    @model_validator(mode="after")
    def _capable(self) -> EngineConfig:
        problems = check_engine(self)
        if problems:
            raise ValueError("\n".join(problems))
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine.url {self.url!r}: expected http://host:port/v1")
        return self


class OpenAIConfig(Section):
    """The explorer's OpenAI-compatible HTTP endpoint (docs/explorer.md#openai-endpoint): served
    when `enabled`, and always for the `agent` workflow, whose functions call it."""

    enabled: bool = Field(default=False,
                          description="serve it for any workflow (agent serves it regardless)")
    address: str = Field(
        default="127.0.0.1:0",
        description="host:port to listen on; port 0 picks a free one (written to "
                    "run_dir/openai/NAME.url); loopback unless you mean to expose the policy")
    model: str = Field(default="policy", min_length=1,
                       description="the model name clients ask for; any other is a 404")
    max_concurrency: int = Field(
        default=64, ge=1, description="requests served at once; the excess is answered 429")
    max_n: int = Field(default=16, ge=1, description="largest `n` a request may ask for")
    max_tokens: int = Field(default=1024, ge=1,
                            description="largest `max_tokens` a request may ask for")
    max_context: int | None = Field(
        default=None, ge=1,
        description="prompt + max_tokens limit; null: the model's max_position_embeddings")
    batch_window: float = Field(
        default=0.005, ge=0,
        description="seconds a request waits for others to share its engine batch")

    @model_validator(mode="after")
    def _address_is_host_port(self) -> OpenAIConfig:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"openai.address {self.address!r}: expected host:port, "
                             "e.g. 127.0.0.1:8000 (port 0 picks a free one)")
        return self


class ExplorerConfig(Section):
    """One explorer process."""

    name: str = Field(default="explorer-0", min_length=1, description="unique among explorers")
    role: Literal["rollout", "eval"] = Field(
        default="rollout",
        description="rollout: rolls out steps for the trainer; eval: only evaluates the `eval` "
                    "tasksets on each published version it can load, never leases tasks nor "
                    "counts in the sync plan (docs/explorer.md)")
    batch_size: int = Field(default=8, ge=1, description="tasks per explorer step")
    repeat_times: int = Field(default=4, ge=1, description="responses per task (the group size)")
    workflow: str = Field(default="single_turn",
                          description="a registered workflow: single_turn, multi_turn, agent "
                                      "(docs/explorer.md) or a plugin's (docs/extending.md)")
    workflow_args: dict[str, Any] = Field(
        default_factory=dict, description="the workflow's arguments (docs/explorer.md)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)
    put_timeout: float = Field(
        default=300.0, gt=0,
        description="seconds to keep retrying a put the buffer refuses as full before failing")
    drain_seconds: float = Field(
        default=30.0, ge=0,
        description="on SIGTERM, seconds the running step may take to finish before its lease "
                    "is abandoned to the master")
    streaming: bool | None = Field(
        default=None,
        description="put each task's group as soon as it is scored, while the step's other "
                    "tasks still generate; null: on in the asynchronous presets (sync.offset: "
                    "null), off in the synchronous ones")
    lease_ahead: bool = Field(
        default=True,
        description="with streaming in an asynchronous plan: once a step's first group is "
                    "scored, ask the master for the next step and roll it out while this one "
                    "drains, so no step boundary idles the engine; false: the next step "
                    "starts after this one is reported")
    on_new_weights: Literal["finish", "interrupt"] = Field(
        default="finish",
        description="weights published while a step generates (asynchronous presets with "
                    "sync.method: checkpoint): finish the step first, or interrupt it at a "
                    "token boundary, load them and resume the partial responses under them "
                    "(transformers and vllm engines)")

    @model_validator(mode="after")
    def _name_is_a_topic(self) -> ExplorerConfig:
        if any(ch.isspace() for ch in self.name) or "/" in self.name or "." in self.name:
            raise ValueError(f"name {self.name!r}: no spaces, '/' or '.' (it names a PUB topic, "
                             "which ZeroMQ matches by prefix, and a weight-group member)")
        return self
