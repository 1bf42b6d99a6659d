"""Fills a service's config dataclass from command-line flags and UPESI_* environment variables.

Every field becomes a flag (`max_num_seqs` -> `--max-num-seqs`) whose default is the environment variable
`UPESI_MAX_NUM_SEQS` when set, else the dataclass default. Help text comes from field metadata["help"].
Read at start-up only, never at import time.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import types
import typing
from urllib.parse import urlsplit, urlunsplit
from typing import Any, TypeVar

T = TypeVar("T")


# options whose values are secrets (keys, or URLs that may carry a password): --help says whether one is set, never
# what it is, and `upesi serve` hands them to its services in the environment, never on a command line
SECRET_OPTIONS = frozenset({"api_key", "cache_secret", "kv_store", "kv_store_key", "registry"})


def env_name(option: str) -> str:
    """The environment variable that sets a config field: UPESI_<NAME>."""
    return f"UPESI_{option.upper()}"


def redact_url(url: str) -> str:
    """A URL as it may be shown: without the password (redis://:SECRET@host -> redis://:***@host)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def option(default: Any, help: str) -> Any:
    """A dataclass field with help text for its flag."""
    return dataclasses.field(default=default, metadata={"help": help})


def _base_type(tp: Any) -> type:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse_bool(v: str | bool) -> bool:
    if isinstance(v, bool):
        return v
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


# --help's sections, in order: a field goes to the first whose patterns (fnmatch) match its name, else "other options"
HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model and hardware", ("model", "hf_overrides", "dtype", "device", "*num_threads", "wide_threads",
                            "max_num_seqs", "max_model_len", "kv_cache_gb", "served_model_name", "chat_template",
                            "*_parser", "progress", "disable_kernels")),
    ("addresses and ports", ("address", "http_*", "*_address", "*_port", "*_replicas", "target", "targets",
                             "prefill_target", "replica_id", "target_wait_s", "ready_timeout_s")),
    ("scheduling", ("block_size", "num_kv_blocks", "prefill_*", "enable_prefix_caching", "stream_interval",
                    "max_num_batched_tokens")),
    ("speculative decoding", ("speculative*", "draft*", "num_speculative_tokens", "num_lookup_tokens", "*speculation*",
                              "proposer")),
    ("quantised weights", ("*act_quant", "dequantise_gguf", "int8_activations")),
    ("KV cache tiers, prefix registry, KV transfer", ("kv_*", "registry", "capture_hidden")),
    ("expert parallelism", ("expert*", "*shard*", "rebalance_*")),
    ("security and limits", ("tls_*", "*api_key*", "cache_secret", "anonymous_*", "grpc_*", "max_*",
                             "default_max_tokens", "*_timeout_s")),
)


def _title(name: str) -> str:
    return next((t for t, pats in HELP_GROUPS if any(fnmatch.fnmatchcase(name, p) for p in pats)), "other options")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for every field of `cls`, in --help's sections (HELP_GROUPS)."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    titles = {f.name: _title(f.name) for f in fields}
    groups = {t: parser.add_argument_group(t) for t in [t for t, _ in HELP_GROUPS] + ["other options"]
              if t in titles.values()}
    for f in fields:
        group = groups[titles[f.name]]
        tp = _base_type(hints[f.name])
        env = env_name(f.name)
        default = os.environ.get(env, f.default)
        text = f.metadata.get("help", "").replace("%", "%%")                 # argparse formats help with %
        # a secret's help says whether it is set; "%(default).0s" prints nothing but stops a defaults-showing
        # formatter from adding the value itself
        shown = ("set" if default else "not set") + "%(default).0s" if f.name in SECRET_OPTIONS else "%(default)s"
        help_text = f"{text} (env {env}; default: {shown})"
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            group.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=_parse_bool(default),
                               help=help_text)
        elif tp is list or typing.get_origin(tp) is list:
            group.add_argument(flag, default=default, help=help_text,
                               type=lambda s: [x for x in s.split(",") if x])
        else:
            # a string default (an UPESI_* value) is converted by argparse only when this (sub)command is parsed,
            # so another command's variable of the same name never breaks this one
            group.add_argument(flag, type=tp, default=default, help=help_text)


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Builds the dataclass; its __post_init__ validates."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**values)
