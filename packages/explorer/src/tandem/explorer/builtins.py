"""tandem-explorer's own engines, workflows and environments, registered as a plugin like any
user's (entry point `tandem.plugins: explorer`).

Each is named by `module:attr` and imported only when a run uses it, so a process that only
checks a config learns every name and every engine's capabilities without importing torch.
"""

from tandem.common.plugins import ENGINES, ENVIRONMENTS, WORKFLOWS, EngineCapabilities

_P = "tandem.explorer"

ENGINES.register("transformers", f"{_P}.transformers_engine:TransformersEngine.from_config",
                 capabilities=EngineCapabilities(interrupt=True))
ENGINES.register("vllm", f"{_P}.vllm_engine:VLLMEngine.from_config",
                 capabilities=EngineCapabilities(interrupt=True, lora_adapters=True,
                                                 tensor_parallel=True))
# A remote server reloads weights from checkpoint files only: no broadcast group reaches it.
ENGINES.register("remote", f"{_P}.remote_engine:RemoteEngine.from_config",
                 capabilities=EngineCapabilities(weights=frozenset({"checkpoint", "fetch"}),
                                                 needs_url=True))

WORKFLOWS.register("single_turn", f"{_P}.workflows.single_turn:SingleTurn")
WORKFLOWS.register("multi_turn", f"{_P}.workflows.multi_turn:MultiTurn")
WORKFLOWS.register("agent", f"{_P}.workflows.agent:Agent")

ENVIRONMENTS.register("calculator", f"{_P}.environments.calculator:Calculator")
ENVIRONMENTS.register("guess_number", f"{_P}.environments.guess_number:GuessNumber")
