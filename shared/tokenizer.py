"""Tokenizer and chat template of a checkpoint (GGUF metadata or a Hugging Face folder)."""
from __future__ import annotations

import os
from typing import Any

from shared.engine.sampling_params import InvalidRequest
from shared.model.loader import is_gguf

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
    """Encodes text and chat messages; decodes ids. Backed by the `tokenizers` library via transformers."""

    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        if is_gguf(path):
            self.hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        else:
            self.hf = AutoTokenizer.from_pretrained(path)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Renders messages with the model's own template and a generation prompt."""
        if not messages:
            raise InvalidRequest("messages is empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role is {m.get('role')!r}; expected one of {sorted(CHAT_ROLES)}")
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a raw prompt instead of messages")
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:   # a template may reject a conversation (e.g. roles out of order)
            raise InvalidRequest(f"the model's chat template rejected these messages: {e}") from None
        return self.encode(text)
