"""Turning a task's prompt or chat messages into prompt tokens: the tokenizer's chat template,
or a plain template when it has none."""

from __future__ import annotations

from typing import Any, Literal

_SENTINEL = "\x00tandem-model-turn\x00"


class PromptTemplate:
    """Renders a chat (a task's messages, or a user prompt plus an optional system prompt) into
    prompt token ids, ending where the model's turn begins.

    `chat="auto"` uses the tokenizer's chat template when it has one and the plain `template`
    otherwise; the plain template is a `str.format` pattern over `{prompt}` and `{system}`. A
    chat without a system message of its own gets `system`. Without a chat template, a chat of
    one user message (after any system messages) is that message's text as `{prompt}`, and a
    longer one is its transcript, a `role: content` line per message and `assistant: ` last.
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

    def render_text(self, prompt: str, system: str | None = None) -> str:
        return self.render_messages_text(self._messages(prompt, system))

    def render(self, prompt: str, system: str | None = None) -> list[int]:
        """Prompt token ids of a user prompt (`system`: this one's system prompt, else the
        template's), with special tokens where the template calls for them."""
        return self.render_messages(self._messages(prompt, system))

    def render_messages_text(self, messages: list[dict[str, Any]]) -> str:
        messages = self._with_system(messages)
        if self.use_chat:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        return self._plain(messages)

    def render_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids of a chat, a list of {role, content} messages."""
        messages = self._with_system(messages)
        if self.use_chat:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                     add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return list(self.tokenizer(self._plain(messages)).input_ids)

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
        messages = self._with_system(self._messages("...")) + [
            {"role": "assistant", "content": _SENTINEL}, {"role": role, "content": text}]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        cut = full.find(_SENTINEL)
        if cut < 0:  # a template that rewrites assistant content: fall back to plain text
            return self.encode_continuation(text)
        return self.encode_continuation(full[cut + len(_SENTINEL):])

    def _messages(self, prompt: str, system: str | None = None) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": prompt}]

    def _with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.system or (messages and messages[0].get("role") == "system"):
            return list(messages)
        return [{"role": "system", "content": self.system}, *messages]

    def _plain(self, messages: list[dict[str, Any]]) -> str:
        lead = 0
        while lead < len(messages) and messages[lead].get("role") == "system":
            lead += 1
        system = "\n".join(message_text(m) for m in messages[:lead])
        turns = messages[lead:]
        if len(turns) == 1 and turns[0].get("role") == "user":
            prompt = message_text(turns[0])
        else:
            prompt = "".join(f"{m.get('role')}: {message_text(m)}\n" for m in turns)
            prompt += "assistant: "
        return self.template.format(prompt=prompt, system=f"{system}\n" if system else "")


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its content, or the text of its parts."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
