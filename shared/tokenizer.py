"""Tokenizer and chat template of a checkpoint (GGUF metadata or a Hugging Face folder)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

from shared.cache_dir import cache_dir
from shared.errors import InvalidRequest
from shared.model_files import file_version, is_gguf

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
log = logging.getLogger(__name__)


def _load_gguf(path: str):
    """A GGUF's tokenizer, converted by transformers once per file version and kept as tokenizer.json under
    ~/.cache/upesi/tokenizers (or $XDG_CACHE_HOME's): the conversion takes about 7 s on a small CPU, and the router,
    the targets and the draft service each load it at start-up; the saved one loads in 0.3 s. Where the cache
    cannot be written, the converted tokenizer is used as it is."""
    import transformers
    from transformers import AutoTokenizer

    version = file_version(os.path.realpath(path))                 # (path, mtime, size)
    key = hashlib.sha256(f"{version}|{transformers.__version__}".encode()).hexdigest()[:16]
    cached = cache_dir("tokenizers") / key
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError) as e:
            log.warning("cached tokenizer %s unreadable (%s); converting the GGUF's again", cached, e)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent)
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)               # atomic; a process that got there first wins
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.info("tokenizer cache not written (%s)", e)
    return hf


class Tokenizer:
    """Encodes text and chat messages; decodes ids. Backed by the `tokenizers` library via transformers."""

    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        if is_gguf(path):
            self.hf = _load_gguf(path)
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
