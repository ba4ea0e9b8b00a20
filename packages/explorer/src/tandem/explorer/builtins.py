"""tandem-explorer's own engines, workflows and environments, registered as a plugin like any
user's (entry point `tandem.plugins: explorer`).

Each is named by `module:attr` and imported only when a run uses it, so a process that only
checks a config learns every name and every engine's capabilities without importing torch.
"""

from tandem.common.plugins import (
    ENGINES, ENVIRONMENTS, TASKSET_READERS, WORKFLOWS, EngineCapabilities)

_P = "tandem.explorer"

# it takes tensors in the explorer's process, so it maps shared-memory versions there too;
# it sleeps by releasing its parameters' storage (placement.colocate)
ENGINES.register("transformers", f"{_P}.engines:transformers",
                 capabilities=EngineCapabilities(
                     weights=frozenset({"broadcast", "checkpoint", "fetch", "shared_memory"}),
                     interrupt=True, sleep=True, multimodal=True))
ENGINES.register("vllm", f"{_P}.engines:vllm",
                 capabilities=EngineCapabilities(interrupt=True, lora_adapters=True,
                                                 tensor_parallel=True, multimodal=True))
# A remote server reloads weights from checkpoint files only: no broadcast group reaches it.
ENGINES.register("remote", f"{_P}.engines:remote",
                 capabilities=EngineCapabilities(weights=frozenset({"checkpoint", "fetch"}),
                                                 needs_url=True, multimodal=True))

# `scorer`/`endpoint`: what the explorer gives the workflow (the reward scorer, its OpenAI
# endpoint); a plugin's workflow declares the same.
WORKFLOWS.register("single_turn", f"{_P}.workflows.single_turn:SingleTurn", scorer=True)
WORKFLOWS.register("multi_turn", f"{_P}.workflows.multi_turn:MultiTurn")
WORKFLOWS.register("agent", f"{_P}.workflows.agent:Agent", endpoint=True)
# environments from elsewhere, run unchanged (docs/explorer.md#environments-from-elsewhere)
WORKFLOWS.register("verifiers", f"{_P}.workflows.verifiers_env:Verifiers", endpoint=True)
WORKFLOWS.register("gym", f"{_P}.workflows.gym_text:Gym", endpoint=True)
# RL from live traffic: an application's conversations (docs/explorer.md#online)
WORKFLOWS.register("online", f"{_P}.online:Online", endpoint=True)

ENVIRONMENTS.register("calculator", f"{_P}.environments.calculator:Calculator")
ENVIRONMENTS.register("guess_number", f"{_P}.environments.guess_number:GuessNumber")

TASKSET_READERS.register("verifiers", f"{_P}.verifiers_loader:read_taskset")
TASKSET_READERS.register("online", f"{_P}.online:read_slots")
