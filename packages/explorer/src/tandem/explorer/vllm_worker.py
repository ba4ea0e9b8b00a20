"""The broadcast and checkpoint receivers of `tandem.weights` inside vLLM's engine workers.

vLLM mixes a `worker_extension_cls` into each of its workers and lets the engine call its
methods on every worker with `collective_rpc` (vLLM's documented RLHF interface)::

    llm = LLM(model, **vllm_engine_kwargs())
    llm.collective_rpc("tandem_join", args=(rendezvous.model_dump(), "explorer-0", 600.0))
    llm.collective_rpc("tandem_receive", args=(version,))           # while the trainer broadcasts
    llm.collective_rpc("tandem_load_checkpoint", args=(run_dir, version))

Each worker joins the trainer's group as `engine_members(explorer, workers)[rank]` and hands
every received bucket to `model_runner.model.load_weights`, which vLLM's model classes
implement for Hugging Face names (including tensor-parallel sharding). vLLM itself is never
imported here: this class is imported by vLLM, inside a worker that already has it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from tandem.weights import WeightReceiver, WeightSubscriber, engine_member

# vLLM imports the extension by this dotted path inside each of its workers.
EXTENSION = f"{__name__}.TandemWeightExtension"


def vllm_engine_kwargs() -> dict[str, str]:
    """Keyword arguments for `vllm.LLM(...)` / `AsyncEngineArgs(...)` that install the extension."""
    return {"worker_extension_cls": EXTENSION}


class TandemWeightExtension:
    """Methods vLLM adds to its worker; `self` is the worker (`rank`, `device`, `model_runner`)."""

    _tandem_receiver: WeightReceiver | None = None
    _tandem_joining: Future | None = None  # the receiver's `join`, running on its own thread

    def _tandem_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0
        last = None

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count, last
            for item in weights:
                count += 1
                last = item[0]
                yield item

        runner = self.model_runner
        try:
            if hasattr(runner, "reload_weights"):
                # vLLM >= 0.32: an in-place reload restores each layer's loader and then
                # re-runs its post-load processing (the CPU backend repacks weights), which a
                # second plain `load_weights` into the processed model cannot do
                runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
                _retie_embeddings(runner.model)
            else:
                runner.model.load_weights(weights=counted())
        except (KeyError, ValueError) as exc:
            # the model class looks each (renamed) tensor up among its parameters
            why = str(exc).split(". ")[0]
            raise ValueError(f"weights: vLLM refused {last!r}: {why}") from None
        return count

    def tandem_join(self, rendezvous: dict, explorer: str, timeout: float) -> str:
        """Start joining the trainer's group (leaving an older epoch); returns this worker's
        member name at once. vLLM runs an rpc method inside its engine's step loop, so a method
        that blocks stalls every request; and a join waits for the trainer's first broadcast,
        which in a synchronous run waits for the rollouts this engine is generating. So the join
        runs on a thread of its own, and `tandem_receive` waits for it."""
        self.tandem_leave()
        member = engine_member(explorer, self.rank)
        receiver = WeightReceiver(rendezvous, member, device=self.device, timeout=timeout,
                                  reuse_buffers=True)  # load_weights copies each tensor
        self._tandem_receiver = receiver
        self._tandem_joining = _on_thread(receiver.join, name=f"tandem-join-{receiver.epoch}")
        return member

    def tandem_receive(self, version: int) -> int:
        """Receive `version` from the trainer and load it; returns the number of tensors."""
        receiver = self._tandem_receiver
        if receiver is None:
            raise RuntimeError("tandem_receive before tandem_join: join the weight group first")
        joining, self._tandem_joining = self._tandem_joining, None
        if joining is not None:
            # bounded: `join` gives up after the receiver's timeout, and within half a second
            # of the group being abandoned or closed
            joining.result(timeout=receiver.timeout + 30)
        return self._tandem_load(receiver.receive(version))

    def tandem_load_checkpoint(self, run_dir: str, version: int | str) -> int:
        """Load `run_dir/weights/v{version}`; returns the number of tensors. (`version` may come
        as a string: vLLM's `/collective_rpc` route passes strings only.)"""
        version = int(version)
        subscriber = WeightSubscriber(run_dir)
        self._tandem_check_names([t.name for t in subscriber.manifest(version).tensors])
        return self._tandem_load(subscriber.load(version))

    def _tandem_check_names(self, names: list[str]) -> None:
        """Refuse a version naming a tensor the model's own checkpoint does not have, before
        anything is loaded: a reload that fails half-way leaves vLLM's model unusable."""
        config = getattr(getattr(self, "vllm_config", None), "model_config", None)
        folder = Path(getattr(config, "model", "") or "")
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            return  # a hub name or another format: vLLM's own loader is the only check
        from safetensors import safe_open

        known: set[str] = set()
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                known.update(handle.keys())
        # a model class may take a name under more than one layout (vLLM's `hf_to_vllm_mapper`:
        # transformers 5 saves Qwen2-VL as `visual.*`, and names it `model.visual.*` in memory,
        # which is what the trainer publishes); names are compared as the model maps them
        mapper = getattr(getattr(self.model_runner, "model", None), "hf_to_vllm_mapper", None)
        if mapper is not None:
            known |= {mapper.map_name(n) for n in known}
            unknown = [n for n in names if n not in known and mapper.map_name(n) not in known]
        else:
            unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"weights: vLLM refused {unknown[0]!r}: the model at {folder} has "
                             f"no such tensor ({len(unknown)} unknown); is this the same "
                             "architecture?")

    def tandem_leave(self) -> None:
        """Leave the current group, if any."""
        if self._tandem_receiver is not None:
            self._tandem_receiver.close()  # a join under way raises within half a second
            self._tandem_receiver = None
        joining, self._tandem_joining = self._tandem_joining, None
        if joining is not None:
            try:
                joining.result(timeout=30)
            except Exception:  # GroupAbandoned, or the join had failed: we are leaving anyway
                pass


def _on_thread(fn: Callable[[], object], name: str) -> Future:
    """Run `fn` on a daemon thread; its result or error comes back through the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _retie_embeddings(model) -> None:
    """Bring a tied `lm_head` up to date with the reloaded embedding. vLLM's in-place reload
    runs post-load processing for one owner of a tied parameter only (its documented limit), so
    the head kept what it derived from the old weights (the CPU backend's packed matmul):
    stale logits otherwise. A vision-language model's text half is its `language_model`."""
    tied = any(getattr(getattr(m, "config", None), "tie_word_embeddings", False)
               for m in (model, getattr(model, "language_model", None)))
    model = getattr(model, "language_model", model)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if tied and embed is not None and head is not None:
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
