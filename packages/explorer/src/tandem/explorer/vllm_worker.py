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

from collections.abc import Iterable, Iterator

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

    def _tandem_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.model_runner.model.load_weights(weights=counted())
        return count

    def tandem_join(self, rendezvous: dict, explorer: str, timeout: float) -> str:
        """Join the trainer's group (leaving an older epoch); returns this worker's member name."""
        self.tandem_leave()
        member = engine_member(explorer, self.rank)
        receiver = WeightReceiver(rendezvous, member, device=self.device, timeout=timeout,
                                  reuse_buffers=True)  # load_weights copies each tensor
        receiver.join()
        self._tandem_receiver = receiver
        return member

    def tandem_receive(self, version: int) -> int:
        """Receive `version` from the trainer and load it; returns the number of tensors."""
        if self._tandem_receiver is None:
            raise RuntimeError("tandem_receive before tandem_join: join the weight group first")
        return self._tandem_load(self._tandem_receiver.receive(version))

    def tandem_load_checkpoint(self, run_dir: str, version: int) -> int:
        """Load `run_dir/weights/v{version}`; returns the number of tensors."""
        return self._tandem_load(WeightSubscriber(run_dir).load(version))

    def tandem_leave(self) -> None:
        """Leave the current group, if any."""
        if self._tandem_receiver is not None:
            self._tandem_receiver.close()
            self._tandem_receiver = None
