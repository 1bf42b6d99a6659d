"""`upesi serve`'s KV store key: made when the stack keeps blocks on disk or in Redis and none is given, kept in the
disk tier's directory (mode 0600) so that a restarted stack authenticates its own blocks, handed to every target."""
from __future__ import annotations

import stat

from services.launcher_commands import children, hide_secrets, with_store_key
from services.serve_config import ServeConfig


def test_a_disk_tier_keeps_its_key_across_runs(tmp_path):
    first = with_store_key(ServeConfig(kv_disk_dir=str(tmp_path / "kv")))
    again = with_store_key(ServeConfig(kv_disk_dir=str(tmp_path / "kv")))
    path = tmp_path / "kv" / "store.key"
    assert len(first.kv_store_key) == 64 and again.kv_store_key == first.kv_store_key
    assert path.read_text() == first.kv_store_key and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_redis_alone_gets_a_key_per_run_and_a_given_key_is_kept():
    url = "redis://127.0.0.1:6399/0"
    a, b = with_store_key(ServeConfig(kv_store=url)), with_store_key(ServeConfig(kv_store=url))
    assert a.kv_store_key and b.kv_store_key and a.kv_store_key != b.kv_store_key
    assert with_store_key(ServeConfig(kv_store=url, kv_store_key="mine")).kv_store_key == "mine"
    assert with_store_key(ServeConfig()).kv_store_key is None                # no store: no key


def test_every_target_gets_the_key_in_its_environment(tmp_path):
    cfg = with_store_key(ServeConfig(kv_store="redis://127.0.0.1:6399/0", target_replicas=2))
    targets = [c for c in children(cfg) if c.name.startswith("target")]
    assert len(targets) == 2
    for t in targets:
        args, env = hide_secrets(t.command)
        assert env["UPESI_KV_STORE_KEY"] == cfg.kv_store_key and cfg.kv_store_key not in args
