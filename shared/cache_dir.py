"""Where Upesi keeps what it builds once per machine (compiled kernels, converted tokenizers)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str, env: str | None = None) -> Path:
    """~/.cache/upesi/NAME (under $XDG_CACHE_HOME when set), or the folder the variable `env` names when set."""
    if env and os.environ.get(env):
        return Path(os.environ[env])
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "upesi" / name
