"""Hugging Face folders on local disk: loading what was saved, as it was saved (never a hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    """The folder's tokenizer, exactly as saved when it was saved as a plain `tokenizer.json`.

    transformers 5 maps a generic fast tokenizer (`TokenizersBackend`) to the model type's own
    class (Qwen2Tokenizer for a Qwen2), which rebuilds the pre-tokenizer and, for a character
    vocabulary, silently drops whitespace; loading it as `PreTrainedTokenizerFast` keeps it intact.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    config_file = path / "tokenizer_config.json"
    declared = (json.loads(config_file.read_text()).get("tokenizer_class")
                if config_file.is_file() else None)
    generic = declared in ("TokenizersBackend", "PreTrainedTokenizerFast")
    if generic and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
