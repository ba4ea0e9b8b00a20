"""Build a tiny causal LM and its tokenizer from nothing: no hub, no download.

The tokenizer is character-level (built with the `tokenizers` library) over a fixed alphabet
that covers arithmetic, short English and the chat markers; the model is a Qwen2 with random
weights from a transformers config. Tests, benchmarks and the quickstart all start here.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
ALPHABET = string.digits + string.ascii_letters + " +-*/=()?.,:;!'\"<>[]{}_#%&@^|~\\$\n\t"


def build_tokenizer(path: str | Path | None = None):
    """A character-level `PreTrainedTokenizerFast`; saved to `path` when given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", clean_up_tokenization_spaces=False)
    if path is not None:
        fast.save_pretrained(str(path))
        # Name the class explicitly: left to guess, AutoTokenizer picks a Qwen2 tokenizer for a
        # Qwen2 folder, whose normaliser drops whitespace this tokenizer treats as characters.
        config_path = Path(path) / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2))
    return fast


def build_tiny_model(path: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 176, max_positions: int = 512,
                     seed: int = 0, tie_embeddings: bool = True):
    """Write a random-init Qwen2 causal LM plus tokenizer to `path` and return (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_sliding_window=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    return model, tokenizer
