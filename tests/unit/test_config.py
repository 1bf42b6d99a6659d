"""Flags and UPESI_* variables fill the service configs; bad values are clear errors."""
from __future__ import annotations

import argparse

import pytest

from services.router.config import RouterConfig
from services.target.config import TargetConfig
from shared.config import add_config_arguments, config_from_args


def parse(cls, argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p, cls)
    return config_from_args(cls, p.parse_args(argv))


def test_defaults_env_and_flags(monkeypatch):
    assert parse(TargetConfig, []).block_size == 16
    monkeypatch.setenv("UPESI_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("UPESI_PROGRESS", "false")
    cfg = parse(TargetConfig, ["--kv-cache-gb", "0.5"])
    assert (cfg.max_num_seqs, cfg.kv_cache_gb, cfg.progress) == (7, 0.5, False)
    assert parse(TargetConfig, ["--max-num-seqs", "3"]).max_num_seqs == 3      # flag beats env
    assert parse(RouterConfig, ["--target", "h:1"]).target == "h:1"


def test_invalid_values_raise():
    with pytest.raises(ValueError):
        parse(RouterConfig, ["--max-n", "0"])
    with pytest.raises(ValueError):
        parse(TargetConfig, ["--kv-cache-gb", "0"]).engine_config()


def test_cli_help_lists_every_command(capsys):
    from services.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for cmd in ("serve", "generate", "router", "target", "draft", "experts"):
        assert cmd in out


@pytest.mark.parametrize("command", ["serve", "generate", "router", "target", "draft", "experts", "quantize"])
def test_every_command_has_a_help_page(capsys, command):
    """Each command's --help renders every flag's text (argparse formats it: a bare % would break it)."""
    from services.cli import build_parser
    with pytest.raises(SystemExit) as done:
        build_parser(only=command).parse_args([command, "--help"])
    assert done.value.code == 0
    assert f"usage: upesi {command}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "router", "target", "draft", "experts"])
def test_help_pages_put_every_flag_in_a_named_section(capsys, command):
    """--help starts with the model and hardware flags and files every other one under a subject (HELP_GROUPS)."""
    from services.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser(only=command).parse_args([command, "--help"])
    out = capsys.readouterr().out
    sections = [line.rstrip(":") for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert "other options" not in sections, out
    if command in ("serve", "target"):
        assert sections[1:3] == ["model and hardware", "addresses and ports"]
        assert out.index("--model ") < out.index("--dtype ") < out.index("--speculative ")


def test_hf_overrides_are_a_json_object():
    from shared.engine.config import parse_hf_overrides
    from services.target.config import TargetConfig
    cfg = parse(TargetConfig, ["--hf-overrides", '{"sliding_window": 4096}'])
    assert cfg.engine_config().hf_overrides == {"sliding_window": 4096}
    assert parse(TargetConfig, []).engine_config().hf_overrides is None
    for bad in ("[1]", "{sliding_window: 4}", '"x"'):
        with pytest.raises(ValueError, match="hf_overrides"):
            parse_hf_overrides(bad)


def test_served_model_names_are_clean():
    from shared.model_files import served_name
    assert served_name("/opt/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_name("/m/Qwen2.5-0.5B-Instruct-q8_0.gguf") == "Qwen2.5-0.5B-Instruct"
    assert served_name("/m/llama.F16.gguf") == "llama"
    assert served_name("/models/Mixtral-tiny/") == "Mixtral-tiny"
    assert served_name("/models/qwen3.gguf") == "qwen3"
