"""Turning a task's text into prompt tokens: the tokenizer's chat template, or a plain template."""

from __future__ import annotations

from typing import Any, Literal

_SENTINEL = "\x00tandem-model-turn\x00"


class PromptTemplate:
    """Renders a user message (plus an optional system prompt) into prompt token ids.

    `chat="auto"` uses the tokenizer's chat template when it has one and the plain `template`
    otherwise; the plain template is a `str.format` pattern over `{prompt}` and `{system}`.
    """

    def __init__(self, tokenizer: Any, *, chat: Literal["auto", "always", "never"] = "auto",
                 template: str = "{system}{prompt}", system: str | None = None):
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if chat == "always" and not has_chat:
            raise ValueError("workflow_args.chat: always, but the tokenizer has no chat template; "
                             "use chat: auto or never")
        if "{prompt}" not in template:
            raise ValueError(f"workflow_args.template {template!r} must contain {{prompt}}")
        self.tokenizer = tokenizer
        self.use_chat = has_chat and chat != "never"
        self.template = template
        self.system = system

    def render_text(self, prompt: str) -> str:
        if self.use_chat:
            return self.tokenizer.apply_chat_template(
                self._messages(prompt), tokenize=False, add_generation_prompt=True)
        system = f"{self.system}\n" if self.system else ""
        return self.template.format(prompt=prompt, system=system)

    def render(self, prompt: str) -> list[int]:
        """Prompt token ids, with special tokens where the template calls for them."""
        if self.use_chat:
            ids = self.tokenizer.apply_chat_template(
                self._messages(prompt), tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return list(self.tokenizer(self.render_text(prompt)).input_ids)

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens of text appended mid-sequence, without adding special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def render_reply(self, text: str, role: str = "user") -> list[int]:
        """Tokens that follow a model turn for an environment's reply, up to the next turn.

        With a chat template: what the template writes between the end of an assistant
        message's content and the start of the next assistant message, with `text` as a message
        of `role` in between (the turn's closing marker, the reply, the generation prompt).
        The model's own tokens are never re-tokenized. Without one: `text` as it is.
        """
        if not self.use_chat:
            return self.encode_continuation(text)
        messages = self._messages("...") + [{"role": "assistant", "content": _SENTINEL},
                                            {"role": role, "content": text}]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        cut = full.find(_SENTINEL)
        if cut < 0:  # a template that rewrites assistant content: fall back to plain text
            return self.encode_continuation(text)
        return self.encode_continuation(full[cut + len(_SENTINEL):])

    def _messages(self, prompt: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": prompt}]
