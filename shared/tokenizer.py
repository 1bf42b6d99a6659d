"""Tokenizer and chat template of a checkpoint (GGUF metadata or a Hugging Face folder).

Served through the `tokenizers` library and the chat-template renderer of transformers (jinja2), neither of which
loads torch, so the router stays a small process. A GGUF's tokenizer is converted to a tokenizer.json folder once
per file version, in a child process (the conversion needs transformers' GGUF reader, which loads torch), and kept
under ~/.cache/upesi/tokenizers (or $XDG_CACHE_HOME's). A Hugging Face folder without a tokenizer.json (a slow,
SentencePiece-only tokenizer) is served by transformers' AutoTokenizer instead.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from shared.cache_dir import cache_dir
from shared.errors import InvalidRequest
from shared.model_files import file_version, is_gguf

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# what a request's chat_template_kwargs may not set: the renderer's own arguments
RESERVED_TEMPLATE_NAMES = frozenset({"conversations", "messages", "chat_template", "tools", "documents",
                                     "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask"})
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
log = logging.getLogger(__name__)


def _cache_key(path: str) -> str:
    import tokenizers

    version = file_version(os.path.realpath(path))                 # (path, mtime, size)
    return hashlib.sha256(f"{version}|tokenizers {tokenizers.__version__}".encode()).hexdigest()[:16]


def convert_gguf(path: str, out: str) -> None:
    """Writes a GGUF's tokenizer as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json and the
    chat template) to `out`. Loads transformers and torch: run it in a child process where that matters."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf.save_pretrained(out)


def _gguf_folder(path: str) -> str:
    """The converted tokenizer folder of a GGUF: from the cache, or converted now (about 7 s on a small CPU) in a
    child process and cached; where the cache cannot be written, in a temporary folder."""
    cached = cache_dir("tokenizers") / _cache_key(path)
    if (cached / "tokenizer.json").exists():
        return str(cached)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        parent = str(cached.parent)
    except OSError as e:
        log.info("tokenizer cache not writable (%s); converting into a temporary folder", e)
        parent = None
    tmp = tempfile.mkdtemp(dir=parent, prefix="converting-")
    done = subprocess.run([sys.executable, "-m", "shared.tokenizer", "convert", path, tmp],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"converting the tokenizer of {path} failed:\n{done.stderr[-2000:]}")
    if parent is None:
        return tmp
    try:
        os.rename(tmp, cached)                   # atomic; a process that got there first wins
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(cached)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken dict with its content."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template is None and (folder / "chat_template.json").exists():
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if isinstance(template, list):                   # named templates: the default one serves chat
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _HFBackend:
    """transformers' AutoTokenizer, for folders without a tokenizer.json (loads torch)."""

    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)


class Tokenizer:
    """Encodes text and chat messages; decodes ids."""

    def __init__(self, path: str) -> None:
        self.path = path
        folder = Path(_gguf_folder(path) if is_gguf(path) else path)
        self.folder = str(folder)
        self._tok = None
        self._fallback: _HFBackend | None = None
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer as Fast

            self._tok = Fast.from_file(str(folder / "tokenizer.json"))
            config_file = folder / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.exists() else {}
            self.special = {k: v for k in SPECIAL_TOKENS if (v := _content(config.get(k))) is not None}
            self.chat_template = _chat_template(folder, config)
        else:
            self._fallback = _HFBackend(self.folder)
            self.special = dict(self._fallback.hf.special_tokens_map)
            self.chat_template = getattr(self._fallback.hf, "chat_template", None)
            if not isinstance(self.chat_template, str):
                self.chat_template = None
        self.has_chat_template = bool(self.chat_template)

    @functools.cached_property
    def hf(self):
        """transformers' tokenizer of the same files, for offline tools (saving it beside a quantised checkpoint);
        loads torch, so serving never touches it."""
        from transformers import AutoTokenizer

        return self._fallback.hf if self._fallback else AutoTokenizer.from_pretrained(self.folder)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special.get("eos_token")
        if eos is None:
            return None
        return self._tok.token_to_id(eos) if self._tok is not None else self._fallback.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return list(self._fallback.hf.encode(text, add_special_tokens=False))
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tok is None:
            return self._fallback.hf.decode(ids, skip_special_tokens=skip_special_tokens,
                                            clean_up_tokenization_spaces=False)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        if self._tok is None:
            return self._fallback.hf.convert_ids_to_tokens(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def use_chat_template(self, template: str) -> None:
        """Renders chats with `template` (Jinja) instead of the model's own."""
        self.chat_template, self.has_chat_template = template, bool(template)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Renders messages with the model's own template and a generation prompt, as transformers'
        apply_chat_template(messages, add_generation_prompt=True, tools=tools) does; template_kwargs: a request's
        extra template variables (any name but the renderer's own). A template that does not render tools gets
        them, and earlier calls and results, as text (shared.tool_calls.as_text)."""
        template_kwargs = template_kwargs or {}
        if not messages:
            raise InvalidRequest("messages is empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role is {m.get('role')!r}; expected one of {sorted(CHAT_ROLES)}")
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a raw prompt instead of messages")
        from transformers.utils.chat_template_utils import render_jinja_template

        reserved = RESERVED_TEMPLATE_NAMES & set(template_kwargs)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {sorted(reserved)}")
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if uses_tools and "tool" not in self.chat_template:
            from shared.tool_calls import as_text
            messages, tools = as_text(messages, tools), None
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            rendered, _ = render_jinja_template(conversations=[chat], chat_template=self.chat_template,
                                                add_generation_prompt=True, tools=tools or None,
                                                **{**self.special, **template_kwargs})
        except Exception as e:   # a template may reject a conversation (e.g. roles out of order)
            raise InvalidRequest(f"the model's chat template rejected these messages: {e}") from None
        return self.encode(rendered[0])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m shared.tokenizer", description="tokenizer utilities")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="write a GGUF's tokenizer as a Hugging Face tokenizer folder")
    c.add_argument("gguf")
    c.add_argument("out")
    args = p.parse_args()
    convert_gguf(args.gguf, args.out)


if __name__ == "__main__":
    main()
