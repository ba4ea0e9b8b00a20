"""tandem's vLLM general plugin: what vLLM needs to serve tandem's vision-language models on a
CPU build without torchvision (docs/vision.md, "vLLM").

vLLM calls `register()` in every process it starts (the caller's, its engine core, its workers,
and the subprocess that inspects a model class), through the `vllm.general_plugins` entry point
of tandem-explorer. Two things:

- vLLM's Qwen2-VL model module imports `smart_resize` from transformers'
  `image_processing_qwen2_vl`, the torchvision-backed image processor, whose module imports
  torchvision at its top. The same function lives in the PIL image processor's module
  (`image_processing_pil_qwen2_vl`), which needs only PIL and numpy, and which is what
  transformers itself falls back to for `Qwen2VLImageProcessor` without torchvision. Where
  torchvision cannot be imported, the torchvision module's name is given the PIL module.
- vLLM's Qwen2-VL loads its processor as `Qwen2VLProcessor.from_pretrained`, which always
  builds the family's video processor, and that needs torchvision. Without torchvision, vLLM is
  made to load the processor class the model folder names (`AutoProcessor`), still checked to
  be a `Qwen2VLProcessor`: tandem's tiny Qwen2-VL names `TinyVLProcessor`, the same processor
  without video (`tandem.weights.tiny_vlm`, imported here so that `AutoProcessor` knows it). A
  folder that names `Qwen2VLProcessor` itself (every hub checkpoint) still needs torchvision.
  Videos need it too: the family serves images only here.

With torchvision installed (a CUDA build of vLLM) neither is changed.
"""

from __future__ import annotations

import importlib.util
import sys

TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def register() -> None:
    """Run by vLLM in each of its processes; safe to run more than once."""
    if _has_torchvision():
        return
    if TORCHVISION_PROCESSOR not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl

        sys.modules[TORCHVISION_PROCESSOR] = image_processing_pil_qwen2_vl
    import tandem.weights.tiny_vlm  # noqa: F401  (registers TinyVLProcessor with AutoProcessor)
    from transformers import Qwen2VLProcessor
    from vllm.model_executor.models.qwen2_vl import Qwen2VLProcessingInfo

    def get_hf_processor(self: Qwen2VLProcessingInfo, **kwargs: object) -> Qwen2VLProcessor:
        # a tuple of classes makes vLLM load through AutoProcessor and check the type
        return self.ctx.get_hf_processor((Qwen2VLProcessor,), **kwargs)

    def get_supported_mm_limits(self: Qwen2VLProcessingInfo) -> dict[str, int | None]:
        return {"image": None}  # videos need the video processor, hence torchvision

    Qwen2VLProcessingInfo.get_hf_processor = get_hf_processor
    Qwen2VLProcessingInfo.get_supported_mm_limits = get_supported_mm_limits


def _has_torchvision() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # built against another torch: "operator torchvision::nms does not exist"
        return False
    return True
