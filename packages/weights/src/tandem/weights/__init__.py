"""tandem-weights: moving weights between the trainer and explorer engines (docs/design.md §5).

Two methods, one ending: both produce an iterator of (name, tensor) for the engine's
`load_weights` (or `load_into(module, ...)` for a plain PyTorch module).

- checkpoint: `WeightPublisher(run_dir).publish(version, named_tensors)` writes
  `weights/v{N}/` atomically; `WeightSubscriber(run_dir).load(version)` checks and memory-maps it.
- shared memory (`weights.transport: shared_memory`, one host): `SharedMemoryPublisher(run_dir)
  .publish(version, named_tensors)` copies a version into a /dev/shm segment;
  `SharedMemorySubscriber(run_dir).load(version)` maps it and yields views.
- broadcast: `WeightBroadcaster.open_group(members)` gives a `GroupRendezvous` to announce;
  `WeightReceiver(rendezvous, member).join()` then `.receive()` on each engine worker, while the
  trainer calls `.broadcast(version, named_tensors)`. gloo on CPU, nccl when all ends are CUDA.
- `hf` (tokenizer loading from a model folder), `tiny` (the tiny Qwen2 the tests build),
  `tiny_vlm` (a tiny Qwen2-VL and its processor, built the same way) and
  `lora` (LoRA adapters folded into full weights: the trainer's published weights and
  `tandem eval` on an adapter checkpoint).

The same receivers run inside vLLM's workers through the explorer's worker extension
(`tandem.explorer.vllm_worker`).
"""

from tandem.common.messages.weights import GroupRendezvous

from .broadcast import BroadcastStats, WeightBroadcaster, WeightReceiver
from .checkpoint import (
    Manifest,
    PublishedVersion,
    WeightPublisher,
    WeightSubscriber,
    list_versions,
    version_dir,
)
from .group import GroupAbandoned, engine_member, engine_members
from .shm import SharedMemoryPublisher, SharedMemorySubscriber
from .tensors import MODEL_DTYPES, WeightsError, load_into, model_dtype, plan_buckets

__all__ = [
    "MODEL_DTYPES", "BroadcastStats", "GroupAbandoned", "GroupRendezvous", "Manifest",
    "PublishedVersion", "SharedMemoryPublisher", "SharedMemorySubscriber",
    "WeightBroadcaster", "WeightPublisher", "WeightReceiver", "WeightSubscriber", "WeightsError",
    "engine_member", "engine_members", "list_versions", "load_into", "model_dtype",
    "plan_buckets", "version_dir",
]
