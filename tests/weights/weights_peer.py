"""The receiving process of the weight-sync tests: an explorer worker, as a real OS process.

    python weights_peer.py broadcast  RENDEZVOUS_JSON MEMBER OUT_DIR VERSIONS TIMEOUT [MODEL_DIR]
    python weights_peer.py checkpoint RUN_DIR OUT_DIR VERSION [MODEL_DIR]
    python weights_peer.py fake-vllm  RENDEZVOUS_JSON EXPLORER OUT_DIR VERSION TIMEOUT
    python weights_peer.py stall      RENDEZVOUS_JSON MEMBER TIMEOUT   (joins, never receives)
    python weights_peer.py shm        RUN_DIR OUT_DIR VERSION [MODEL_DIR]  (maps a segment)
    python weights_peer.py shm-hold   RUN_DIR VERSION      (maps it, says "holding", keeps it)
    python weights_peer.py shm-publish RUN_DIR VERSIONS    (publishes them, says "published
                  TRACKER_PID", then publishes one more and stops inside it, before its rename)

VERSIONS is a comma-separated list, received one after the other in the same group. With a
MODEL_DIR, each version is loaded into a fresh copy of that Hugging Face model (`load_into`);
without one, into a plain dict (an engine without transformers: starts in a second, not ten).
Either way the loaded tensors are written to OUT_DIR/v{N}.safetensors for the test to compare
bit by bit. A peer that joins a group (broadcast, fake-vllm, stall) prints "ready" just before
it joins. Exit code 0 on success, 3 on a tandem error (its message on stderr).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

from backstop import BACKSTOP


class DictEngine:
    """An engine whose `load_weights` copies every tensor into a dict."""

    def __init__(self):
        self.state = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.state[name] = tensor.clone()


class ModuleEngine:
    """An engine around a Hugging Face model: `load_weights` is `load_into`."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.module = AutoModelForCausalLM.from_pretrained(model_dir)

    def load_weights(self, weights):
        from tandem.weights import load_into

        load_into(self.module, weights)

    @property
    def state(self):
        return {n: p.detach() for n, p in self.module.named_parameters()}


class FakeVllmWorker:
    """Stands in for vLLM's GPU worker (which cannot exist on this machine): the attributes
    the extension relies on, `rank`, `device` and `model_runner.model.load_weights`."""

    class _Runner:
        def __init__(self, model):
            self.model = model

    def __init__(self, engine):
        self.rank = 0
        self.device = "cpu"
        self.model_runner = self._Runner(engine)


def dump(engine, out_dir: str, version: int) -> None:
    from safetensors.torch import save_file

    state = {n: t.contiguous() for n, t in engine.state.items()}
    save_file(state, str(Path(out_dir) / f"v{version}.safetensors"))


def shm_publish(run_dir: str, versions: str) -> None:
    """A trainer that dies with segments published and one being written."""
    from multiprocessing import resource_tracker
    from unittest import mock

    import torch

    from tandem.weights import shm

    publisher = shm.SharedMemoryPublisher(run_dir, keep=10)
    tensors = [("w", torch.arange(1000, dtype=torch.float32))]
    for version in (int(v) for v in versions.split(",")):
        publisher.publish(version, tensors)
    print("published", resource_tracker._resource_tracker._pid, flush=True)

    def stop_before_rename(src, dst):
        print("writing", flush=True)  # the test kills here: a whole tmp segment, not renamed
        time.sleep(BACKSTOP)

    with mock.patch.object(shm.os, "rename", stop_before_rename):
        publisher.publish(99, tensors)


def ready() -> None:
    """Imports and engine done: the test's spawn() returns, and this process joins next."""
    print("ready", flush=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tandem.common.errors import TandemError
    from tandem.weights import WeightReceiver, WeightSubscriber

    mode, args = argv[0], argv[1:]
    try:
        if mode == "broadcast":
            rendezvous, member, out_dir, versions, timeout, *model = args
            engine = ModuleEngine(model[0]) if model else DictEngine()
            receiver = WeightReceiver(json.loads(rendezvous), member, timeout=float(timeout))
            ready()
            receiver.join()
            for version in (int(v) for v in versions.split(",")):
                engine.load_weights(receiver.receive(version))
                dump(engine, out_dir, version)
            receiver.close()
        elif mode == "checkpoint":
            run_dir, out_dir, version, *model = args
            engine = ModuleEngine(model[0]) if model else DictEngine()
            engine.load_weights(WeightSubscriber(run_dir).load(int(version)))
            dump(engine, out_dir, int(version))
        elif mode == "fake-vllm":
            from tandem.explorer.vllm_worker import TandemWeightExtension

            rendezvous, explorer, out_dir, version, timeout = args
            engine = DictEngine()
            worker = type("Worker", (TandemWeightExtension, FakeVllmWorker), {})(engine)
            ready()
            worker.tandem_join(json.loads(rendezvous), explorer, float(timeout))
            count = worker.tandem_receive(int(version))
            worker.tandem_leave()
            (Path(out_dir) / "count.json").write_text(json.dumps({"tensors": count}))
            dump(engine, out_dir, int(version))
        elif mode == "shm":
            from tandem.weights.shm import SharedMemorySubscriber

            run_dir, out_dir, version, *model = args
            engine = ModuleEngine(model[0]) if model else DictEngine()
            engine.load_weights(SharedMemorySubscriber(run_dir).load(int(version)))
            dump(engine, out_dir, int(version))
        elif mode == "shm-hold":
            from tandem.weights.shm import SharedMemorySubscriber

            run_dir, version = args
            held = list(SharedMemorySubscriber(run_dir).load(int(version)))  # views: mapped
            print("holding", flush=True)
            time.sleep(BACKSTOP)
            del held
        elif mode == "shm-publish":
            shm_publish(*args)
        elif mode == "stall":
            rendezvous, member, timeout = args
            receiver = WeightReceiver(json.loads(rendezvous), member, timeout=float(timeout))
            ready()
            receiver.join()
            time.sleep(BACKSTOP)  # holding `receiver`: a member that is there but never takes part
        else:
            print(f"unknown mode {mode!r}", file=sys.stderr)
            return 2
    except TandemError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
