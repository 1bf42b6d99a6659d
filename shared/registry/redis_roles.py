"""Redis ACL users, one per role, each confined to its keys (docs/security.md): the rules compose.yaml and
deploy/redis-deployment.yaml give redis-server, and tests/integration/test_redis_acl.py runs on a real one.

    upesi-router     reads the registry (`upesi:reg:`); writes nothing, reads no KV block
    upesi-registry   the targets' registry publisher: reads and writes `upesi:reg:` only
    upesi-kv         the targets' KV block store (`upesi:kv:`, its own database): nothing of the registry
"""
from __future__ import annotations

_BASE = "resetchannels -@all +ping +select +hello"
_WRITER = "+@read +@write +@scripting +@transaction -@dangerous"
RULES: dict[str, str] = {
    "upesi-router": f"~upesi:reg:* {_BASE} +@read -@dangerous",
    "upesi-registry": f"~upesi:reg:* {_BASE} {_WRITER}",
    "upesi-kv": f"~upesi:kv:* {_BASE} {_WRITER}",
}


def user_line(user: str, password: str) -> str:
    """A redis.conf `user` line (without the word): the user on, its password and its role's rules."""
    return f"{user} on >{password} {RULES[user]}"
