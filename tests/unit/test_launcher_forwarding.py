"""`upesi serve` hands every setting it shares with the target's config to its targets (services.launcher_commands
.forwarded): a target's command line, parsed as `upesi target` parses it, gives the serve config's values; prefill
targets get the same but speculation's; settings the launcher composes per replica keep their own rules."""
from __future__ import annotations

import argparse
import dataclasses

from services.launcher_commands import DECODE_ONLY, TARGET_COMPOSED, children
from services.serve_config import ServeConfig
from services.target.config import TargetConfig
from shared.config import add_config_arguments, config_from_args

SETTINGS = dict(dtype="float32", device="cpu", kv_cache_gb=0.75, max_num_seqs=7, num_threads=1, wide_threads=2,
                num_speculative_tokens=5, adaptive_speculation=False, speculation_guard=True, speculative_max_seqs=3,
                stream_interval=2, speculative="ngram", draft_confidence=0.3, draft_tree_nodes=6, draft_tree_ngram=2,
                prefill_itl_stretch=3.5, dequantise_gguf=True, nvfp4_act_quant=True, target_replicas=2,
                prefill_replicas=1, hf_overrides='{"rope_theta": 20000.0}')


def parsed(command: list[str]) -> TargetConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TargetConfig)
    return config_from_args(TargetConfig, parser.parse_args(command[1:]))


def test_every_shared_setting_reaches_the_targets_and_prefill_targets_skip_speculation():
    cfg = ServeConfig(**SETTINGS)
    shared = [f.name for f in dataclasses.fields(TargetConfig)
              if hasattr(cfg, f.name) and f.name not in TARGET_COMPOSED]
    assert {"dtype", "kv_cache_gb", "speculation_guard", "prefill_itl_stretch", "dequantise_gguf"} <= set(shared)
    kids = {c.name: parsed(c.command) for c in children(cfg) if "target" in c.name}
    assert sorted(kids) == ["prefill target 0", "target 0", "target 1"]
    defaults = TargetConfig()
    for name in shared:
        for kid, got in kids.items():
            want = getattr(defaults, name) if kid.startswith("prefill") and name in DECODE_ONLY else getattr(cfg, name)
            assert getattr(got, name) == want, (kid, name)


def test_composed_settings_keep_their_own_rules():
    cfg = ServeConfig(kv_disk_dir="/tmp/kv", target_replicas=2)
    t0, t1 = (parsed(c.command) for c in children(cfg) if c.name.startswith("target"))
    assert (t0.kv_disk_dir, t1.kv_disk_dir) == ("/tmp/kv/target-0", "/tmp/kv/target-1")    # one directory each
    assert t0.address != cfg.address                                                          # not the router's


def test_the_router_gets_the_shared_settings_and_the_draft_services_address():
    from services.launcher_commands import router_command
    from services.router.config import RouterConfig
    cfg = ServeConfig(draft="ngram", speculative_max_requests=2, reasoning_parser="think", served_model_name="m",
                      tool_call_parser="mistral", http_port=8123)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RouterConfig)
    got = config_from_args(RouterConfig, parser.parse_args(router_command(cfg)[1:]))
    assert (got.speculative_max_requests, got.reasoning_parser, got.served_model_name, got.tool_call_parser,
            got.http_port, got.address) == (2, "think", "m", "mistral", 8123, cfg.address)
    assert got.draft == cfg.draft_address                  # the router's draft is the service, not the proposer
