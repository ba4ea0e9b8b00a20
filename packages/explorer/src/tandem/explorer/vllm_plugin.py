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

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
VLLM_QWEN2_VL = "vllm.model_executor.models.qwen2_vl"


def register() -> None:
    """Run by vLLM in each of its processes; safe to run more than once. Costs nothing until
    vLLM imports its Qwen2-VL module (importing it here would add seconds to every process of
    a text-only run)."""
    if any(isinstance(f, _Qwen2VLHook) for f in sys.meta_path) or _has_torchvision():
        return
    if VLLM_QWEN2_VL in sys.modules:
        _prepare()
        _patch(sys.modules[VLLM_QWEN2_VL])
    else:
        sys.meta_path.insert(0, _Qwen2VLHook())


class _Qwen2VLHook(importlib.abc.MetaPathFinder):
    """Finds vLLM's Qwen2-VL module as usual, and wraps its loading in `_prepare`/`_patch`."""

    def find_spec(self, name, path, target=None):
        if name != VLLM_QWEN2_VL:
            return None
        sys.meta_path.remove(self)  # once; and find_spec below must not find this hook again
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _prepare()
        self.loader.exec_module(module)
        _patch(module)


def _prepare() -> None:
    if TORCHVISION_PROCESSOR not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl

        sys.modules[TORCHVISION_PROCESSOR] = image_processing_pil_qwen2_vl
    import tandem.weights.tiny_vlm  # noqa: F401  (registers TinyVLProcessor with AutoProcessor)


def _patch(module: ModuleType) -> None:
    from transformers import Qwen2VLProcessor

    info = module.Qwen2VLProcessingInfo

    def get_hf_processor(self, **kwargs: object) -> Qwen2VLProcessor:
        # a tuple of classes makes vLLM load through AutoProcessor and check the type
        return self.ctx.get_hf_processor((Qwen2VLProcessor,), **kwargs)

    def get_supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None}  # videos need the video processor, hence torchvision

    info.get_hf_processor = get_hf_processor
    info.get_supported_mm_limits = get_supported_mm_limits


def _has_torchvision() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # built against another torch: "operator torchvision::nms does not exist"
        return False
    return True
