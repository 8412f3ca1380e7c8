"""Token-in, token-out chat context: the envpool tokenizes, and only the environment's text.

A multi-turn episode's context is built by *appending token ids*, never by re-rendering and
re-tokenizing the conversation: the tokens the model generated stay exactly as generated (BPE is
not round-trip stable, so decode-then-encode can change them, and the learner would then train on
tokens the policy never produced).

    chat = ChatFormat.from_model_dir(path)
    ids = chat.first_prompt(system, observation)      # rendered with the model's chat template
    ...model generates `response` ids (ending with the end-of-turn token, or cut by length)...
    ids += chat.close_turn(response) + chat.next_prompt(observation)

`next_prompt` is derived from the model's own chat template (rendered with jinja2, like
transformers does): render a conversation with and without one more user turn and keep the
difference. So any template with a fixed turn structure works, not only ChatML.

This module uses `tokenizers` and `jinja2` only: the envpool never imports torch.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

__all__ = ["ChatFormat"]

_PROBE_USER, _PROBE_ASSISTANT = "\x00user-probe\x00", "\x00assistant-probe\x00"


class ChatFormat:
    def __init__(
        self, tokenizer: Tokenizer, chat_template: str, eos_token: str, stop_tokens: list[str]
    ) -> None:
        self.tokenizer = tokenizer
        self._template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template)
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"end-of-turn token {eos_token!r} is not in the vocabulary")
        self.eos_id = eos
        self.stop_token_ids = sorted(
            {eos, *(i for t in stop_tokens if (i := tokenizer.token_to_id(t)) is not None)}
        )
        self._eos_text = eos_token
        self._after_eos = self._text_after_assistant()
        self._probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]
        self._probe_text = self.render(self._probe, add_generation_prompt=False)
        # The members of a group share their first prompt; rendering a template is the
        # envpool's biggest CPU cost per episode after the transport, so cache it (bounded).
        self._first: OrderedDict[tuple[str, str], list[int]] = OrderedDict()

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatFormat:
        path = Path(path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if not template:
            raise ValueError(f"{path}/tokenizer_config.json has no chat_template")
        eos = config.get("eos_token")
        eos = eos["content"] if isinstance(eos, dict) else eos
        return cls(
            Tokenizer.from_file(str(path / "tokenizer.json")), template, eos, stop_tokens=["<|endoftext|>"]
        )

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    FIRST_PROMPT_CACHE = 1024

    def first_prompt(self, system: str, observation: str) -> list[int]:
        key = (system, observation)
        ids = self._first.get(key)
        if ids is None:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": observation})
            ids = self._first[key] = self.encode(self.render(messages, add_generation_prompt=True))
            if len(self._first) > self.FIRST_PROMPT_CACHE:
                self._first.popitem(last=False)
        else:
            self._first.move_to_end(key)
        return list(ids)  # callers may extend it

    def close_turn(self, response_ids: list[int]) -> list[int]:
        """Tokens that end the assistant turn after `response_ids` (not generated, no loss).

        If the model stopped on its end-of-turn token, only the template's text after that token
        (ChatML: a newline) is added; if it was cut by the length limit, the end token too.
        """
        missing = [] if response_ids and response_ids[-1] in self.stop_token_ids else [self.eos_id]
        return missing + self._after_eos

    def next_prompt(self, observation: str) -> list[int]:
        """Tokens of one more user turn plus the generation prompt."""
        before = self._probe_text
        after = self.render(
            self._probe + [{"role": "user", "content": observation}], add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ValueError("the chat template re-renders earlier turns; cannot extend token-wise")
        return self.encode(after[len(before) :])

    def _text_after_assistant(self) -> list[int]:
        rendered = self.render(
            [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}],
            add_generation_prompt=False,
        )
        marker = _PROBE_ASSISTANT + self._eos_text
        at = rendered.find(marker)
        if at < 0:
            raise ValueError("the chat template does not end assistant turns with the eos token")
        return self.encode(rendered[at + len(marker) :])

    def apply(
        self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of a whole conversation as the template renders it (placeholder; item 1 replaces)."""
        text = self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
        return self.encode(text)
