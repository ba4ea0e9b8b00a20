"""The run config's names checked against the registries (`tandem.common.plugins`), and the
rules that follow from what a registered engine declares it can do.

A registry no installed package fills (the explorer is not installed in a control-plane-only
image, say) is not checked here: the component that uses it checks the name when it starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plugins import (
    ADVANTAGES, AGENTS, CORRECTIONS, ENGINES, ENVIRONMENTS, REWARDS, TASKSET_FORMATS,
    TASKSET_READERS, WORKFLOWS, EngineCapabilities, load_installed)
from ..registry import Registry

if TYPE_CHECKING:
    from . import RunConfig
    from .explorer import EngineConfig


def _check(registry: Registry, name: object, where: str, problems: list[str]) -> bool:
    """Append a problem if `name` is not registered; True when it is (or cannot be checked)."""
    if not len(registry) or not isinstance(name, str):
        return True
    if name not in registry:
        problems.append(registry.unknown(name, where))
        return False
    return True


def engine_capabilities(kind: str) -> EngineCapabilities | None:
    """What the engine registered as `kind` declares; None where no engine is registered."""
    load_installed()
    if kind not in ENGINES:
        return None
    caps = ENGINES.declares(kind).get("capabilities")
    return caps if isinstance(caps, EngineCapabilities) else EngineCapabilities()


def check_engine(engine: EngineConfig) -> list[str]:
    """The `engine` section's own rules, from the engine's declared capabilities."""
    problems: list[str] = []
    load_installed()
    if not _check(ENGINES, engine.kind, "engine.kind", problems):
        return problems
    caps = engine_capabilities(engine.kind)
    if caps is None:
        return problems
    if engine.tensor_parallel_size > 1 and not caps.tensor_parallel:
        problems.append(f"engine.tensor_parallel_size: engine.kind {engine.kind} does not "
                        f"split a model over devices; use an engine that declares "
                        f"tensor_parallel ({_having('tensor_parallel')}) or 1")
    if caps.needs_url and not engine.url:
        problems.append(f"engine.url: engine.kind: {engine.kind} needs the server's base URL, "
                        "e.g. http://gpu-host:8000/v1")
    return problems


def _having(capability: str) -> str:
    names = [n for n, e in ENGINES.items()
             if getattr(e.declares.get("capabilities"), capability, False)]
    return ", ".join(names) or "none registered"


def check_names(config: RunConfig) -> list[str]:
    """Every registry name the run config uses, and the cross-section rules that depend on an
    engine's capabilities; one problem per line, each naming its key."""
    load_installed()
    problems: list[str] = []
    for name in config.reward.functions:
        _check(REWARDS, name, f"reward.functions.{name}", problems)
    _check(ADVANTAGES, config.trainer.advantage, "trainer.advantage", problems)
    for i, correction in enumerate(config.trainer.corrections):
        _check(CORRECTIONS, correction.name, f"trainer.corrections[{i}].name", problems)
    taskset = config.master.taskset
    if taskset.reader:
        _check(TASKSET_READERS, taskset.reader, "master.taskset.reader", problems)
    if taskset.format is not None:
        _check(TASKSET_FORMATS, taskset.format.name, "master.taskset.format.name", problems)
    for e in config.explorers:
        at = f"explorers[{e.name}]"
        _check(WORKFLOWS, e.workflow, f"{at}.workflow", problems)
        args = e.workflow_args
        if "reward_fn" in args:
            _check(REWARDS, args["reward_fn"], f"{at}.workflow_args.reward_fn", problems)
        if "env" in args and e.workflow == "multi_turn":
            _check(ENVIRONMENTS, args["env"], f"{at}.workflow_args.env", problems)
        if e.workflow == "agent" and isinstance(args.get("fn"), str) and ":" not in args["fn"]:
            _check(AGENTS, args["fn"], f"{at}.workflow_args.fn", problems)
        caps = engine_capabilities(e.engine.kind)
        if caps is None:
            continue
        kind = f"{at}.engine.kind: {e.engine.kind}"
        if config.sync.method == "nccl" and "broadcast" not in caps.weights:
            problems.append(f"sync.method: nccl broadcasts weights, which {kind} cannot take "
                            f"(it loads them by {', '.join(sorted(caps.weights))}); use "
                            "sync.method: checkpoint")
        elif config.sync.method == "checkpoint":
            transport = config.weights.transport
            path = "checkpoint" if transport == "shared_fs" else transport
            if path not in caps.weights:
                what = ("shared-memory segments in the explorer's process"
                        if path == "shared_memory" else "checkpoint files")
                problems.append(f"weights.transport: {transport} hands {kind} {what}, which "
                                f"it cannot load (it takes {', '.join(sorted(caps.weights))})")
        if e.on_new_weights == "interrupt" and not caps.interrupt:
            problems.append(f"{at}.on_new_weights: interrupt needs an engine that declares "
                            f"interrupt ({_having('interrupt')}), not {e.engine.kind}; use "
                            "on_new_weights: finish")
        if e.name in config.placement.colocate and not caps.sleep:
            problems.append(f"placement.colocate: {kind} cannot sleep (release its weights "
                            f"while the trainer trains); use an engine that declares sleep "
                            f"({_having('sleep')})")
        if config.weights.lora_transfer == "adapter" and not caps.lora_adapters:
            problems.append(f"{kind} cannot load LoRA adapters (weights.lora_transfer: "
                            f"adapter); use an engine that declares lora_adapters "
                            f"({_having('lora_adapters')}) or weights.lora_transfer: merged")
    return problems
