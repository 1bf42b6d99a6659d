"""API keys for the router's public APIs: one check for gRPC (`authorization` metadata) and HTTP (the header).

Keys are optional. Without them every request is served as one anonymous caller under the router's own limits. With
them (`--api-key KEY` and/or `--api-keys-file FILE`) a request must carry `authorization: Bearer <key>`; the gRPC
health and reflection services and HTTP /health and /metrics stay open (probes and Prometheus scrapers carry no key;
/metrics holds counts only, never a key or a prompt). The keys file is YAML:

    defaults:                      # optional: limits for every key that does not set its own
      max_prompt_tokens: 4096
      max_tokens: 512              # the largest max_tokens a request may ask for (unset is capped to it)
      max_n: 4
      max_concurrent_requests: 8   # this key's requests in flight at once
      requests_per_minute: 60      # over the last 60 s; beyond it 429 with Retry-After
      tokens_per_minute: 20000     # prompt tokens as admitted plus output tokens as they end
    keys:
      - name: alice                # optional; errors and logs name the key by it, never by its secret
        key: sk-alice-0123456789
        max_tokens: 64
      - key: sk-bob-9876543210

Each limit is the strictest of the router's flags, the file's defaults and the key's own field; a key given with
--api-key (better: UPESI_API_KEY, which `ps` does not show) has the router's flags only. With two keys or more, no
key may hold more than half of --max-concurrent-requests at once, so one key's flood leaves the router room for the
others (whose requests the targets then admit fairly: shared/engine/scheduler.py). Keys are compared as SHA-256
digests with hmac.compare_digest, against every configured key, so the time taken tells nothing about them.

Each key has its own partition of the prefix cache: its requests' blocks are hashed with HMAC-SHA256(secret, the
key's digest) before the client's `cache_salt`. The secret is `--cache-secret` (UPESI_CACHE_SECRET; give every
router of a deployment the same one), else derived from all configured keys' digests, which is stable across
restarts and equal on routers that share the keys; anonymous callers (no keys configured) share one partition,
so their `cached_tokens` read 0 unless a request brings its own `cache_salt` (or --anonymous-cached-tokens).
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import yaml

from services.router.config import RouterConfig
from services.router.limits import Caller, Limits
from shared.errors import Unauthenticated

_KEY_FIELDS = {"name", "key"}


def _load_file(path: str, base: Limits) -> list[tuple[str, Caller]]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the API keys file {path}: {e}") from None
    if not isinstance(data, dict) or set(data) - {"defaults", "keys"}:
        raise ValueError(f"{path}: expected a mapping with 'defaults' and 'keys'")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"{path}: defaults must be a mapping of limits")
    base = base.tightened(Limits.from_mapping(defaults, f"{path}: defaults"))
    entries = data.get("keys") or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: keys must be a list")
    out = []
    for i, entry in enumerate(entries):
        where = f"{path}: keys[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"].strip():
            raise ValueError(f"{where}: every entry needs a non-empty string 'key'")
        limits = {k: v for k, v in entry.items() if k not in _KEY_FIELDS}
        name = str(entry.get("name") or f"key #{i}")
        out.append((entry["key"].strip(), Caller(name, base.tightened(Limits.from_mapping(limits, where)))))
    return out


def _digest(key: str) -> bytes:
    # Equal-length digests: compare_digest then takes the same time whatever the key's length or content.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyTable:
    """The configured keys and the caller each one stands for."""

    def __init__(self, keys: list[tuple[str, Caller]], base: Limits, cache_secret: str | None = None) -> None:
        digests = [_digest(k) for k, _ in keys]
        if len(set(digests)) != len(digests):
            raise ValueError("an API key is listed twice")
        self._keys = [(d, c) for d, (_, c) in zip(digests, keys)]
        self.anonymous = None if keys else Caller("", base)
        secret = (cache_secret.encode() if cache_secret else
                  hashlib.sha256(b"upesi cache partitions\x00" + b"".join(sorted(digests))).digest())
        for digest, caller in self._keys:
            caller.partition = hmac.new(secret, digest, hashlib.sha256).hexdigest()

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> KeyTable:
        """The keys of --api-key and --api-keys-file, under the router's own limits (0 = none of its own)."""
        base = Limits(cfg.max_prompt_tokens or None, cfg.max_output_tokens or None, cfg.max_n)
        keys = _load_file(cfg.api_keys_file, base) if cfg.api_keys_file else []
        if cfg.api_key:
            keys.append((cfg.api_key, Caller("api-key", base)))
        if cfg.api_keys_file and not keys:
            raise ValueError(f"{cfg.api_keys_file} lists no keys; remove the option to serve without keys")
        if len(keys) > 1:
            share = Limits(max_concurrent_requests=max(1, cfg.max_concurrent_requests // 2))
            for _, caller in keys:
                caller.limits = caller.limits.tightened(share)
        return cls(keys, base, cfg.cache_secret)

    @property
    def required(self) -> bool:
        return self.anonymous is None

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller of a request from its `authorization` value; raises Unauthenticated when keys are configured
        and it carries none or a wrong one."""
        if self.anonymous is not None:
            return self.anonymous
        if not authorization:
            raise Unauthenticated("no API key given; send it as 'authorization: Bearer <key>' (an HTTP header, "
                                  "or gRPC metadata)", missing=True)
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the authorization value must be 'Bearer <key>'")
        given = _digest(token.strip())
        found: Caller | None = None
        for digest, caller in self._keys:                 # every key is compared: no early exit
            if hmac.compare_digest(given, digest):
                found = caller
        if found is None:
            raise Unauthenticated("incorrect API key provided")
        return found

