"""The receiving process of the weight-sync tests: an explorer worker, as a real OS process.

    python peer.py broadcast  RENDEZVOUS_JSON MEMBER MODEL_DIR OUT_DIR VERSION[,VERSION...] TIMEOUT
    python peer.py checkpoint RUN_DIR MODEL_DIR OUT_DIR VERSION
    python peer.py fake-vllm  RENDEZVOUS_JSON EXPLORER MODEL_DIR OUT_DIR VERSION TIMEOUT

Each received version is loaded into a fresh copy of the tiny model and its parameters are
written to OUT_DIR/v{N}.safetensors for the test to compare bit by bit. Exit code 0 on
success, 3 on a tandem error (its message on stderr).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path


def dump(model, out_dir: str, version: int) -> None:
    from safetensors.torch import save_file

    state = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(state, str(Path(out_dir) / f"v{version}.safetensors"))


def fresh_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


class FakeVllmWorker:
    """Stands in for vLLM's GPU worker (which cannot exist on this machine): the attributes
    the extension relies on, `rank`, `device` and `model_runner.model.load_weights`."""

    class _Runner:
        def __init__(self, model):
            self.model = model

    class _Model:
        def __init__(self, module):
            self.module = module

        def load_weights(self, weights):
            from tandem.common.weights import load_into

            return load_into(self.module, weights)

    def __init__(self, module):
        self.rank = 0
        self.device = "cpu"
        self.model_runner = self._Runner(self._Model(module))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tandem.common.errors import TandemError
    from tandem.common.weights import WeightReceiver, WeightSubscriber, load_into

    mode = argv[0]
    try:
        if mode == "broadcast":
            rendezvous, member, model_dir, out_dir, versions, timeout = argv[1:]
            model = fresh_model(model_dir)
            receiver = WeightReceiver(json.loads(rendezvous), member, timeout=float(timeout))
            receiver.join()
            for version in (int(v) for v in versions.split(",")):
                load_into(model, receiver.receive(version))
                dump(model, out_dir, version)
            receiver.close()
        elif mode == "checkpoint":
            run_dir, model_dir, out_dir, version = argv[1:]
            model = fresh_model(model_dir)
            load_into(model, WeightSubscriber(run_dir).load(int(version)))
            dump(model, out_dir, int(version))
        elif mode == "fake-vllm":
            from tandem.common.weights.vllm import TandemWeightExtension

            rendezvous, explorer, model_dir, out_dir, version, timeout = argv[1:]
            worker_cls = type("Worker", (TandemWeightExtension, FakeVllmWorker), {})
            model = fresh_model(model_dir)
            worker = worker_cls(model)
            worker.tandem_join(json.loads(rendezvous), explorer, float(timeout))
            worker.tandem_receive(int(version))
            worker.tandem_leave()
            dump(model, out_dir, int(version))
        else:
            print(f"unknown mode {mode!r}", file=sys.stderr)
            return 2
    except TandemError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
