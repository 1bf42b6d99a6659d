"""A model path that does not exist stops `upesi serve` before it starts any service: one clear line and exit
status 2, not a traceback from each service (services/launcher.py resolves the path first)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_with_a_missing_model_says_so_in_one_line(tmp_path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    run = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(missing)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr + run.stdout
    assert run.stderr.strip().splitlines() == [f"upesi serve: model path {str(missing)!r} does not exist "
                                               "(give a .gguf file or a Hugging Face folder)"]
