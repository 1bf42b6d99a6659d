"""The `upesi` command line."""
from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = """Upesi: LLM inference as gRPC microservices.

  upesi serve                 start the whole stack (router, target, optional draft and expert shards) here
  upesi generate "prompt"     stream an answer from a running stack
  upesi router|target|...     start one service (what compose and Kubernetes run)

Every flag also reads an UPESI_* environment variable (e.g. --max-num-seqs <- UPESI_MAX_NUM_SEQS)."""


# command -> (help, the module with its add_arguments and main)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("start the stack as child processes: router, targets, optional draft and expert shards",
              "services.launcher"),
    "generate": ("stream an answer from a running stack", "services.generate_cmd"),
    "quantize": ("write an NVFP4 (compressed-tensors) checkpoint of a model", "services.quantize_cmd"),
    "router": ("run the router: public gRPC API (and HTTP /health, /metrics)", "services.router.main"),
    "target": ("run a target: model, paged KV cache, continuous batching", "services.target.main"),
    "experts": ("run an expert shard: the FFN weights placed on it, stateless batched compute",
                "services.experts.main"),
    "draft": ("run a draft service: drives speculative decoding with a target over a Verify stream (n-gram, a small "
              "draft model or an EAGLE head)", "services.draft.main"),
    "train-draft": ("train an EAGLE-style draft head for a target by self-distillation", "services.train_draft_cmd"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with `only`, the flags of that command alone are loaded (a service process
    imports its own modules only: the router never loads the target's torch code)."""
    p = argparse.ArgumentParser(prog="upesi", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="INFO", help="logging level of the services (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module_name) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(func=module.main)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only=next((a for a in argv if a in COMMANDS), "")).parse_args(argv)
    from shared.model_files import ModelNotFound
    from shared.rpc.ports import ListenError
    from shared.rpc.server import setup_logging

    setup_logging(args.log_level)
    try:
        args.func(args)
    except (ValueError, ListenError, ModelNotFound) as e:   # bad config, a taken port, no model: a line, no traceback
        print(f"upesi {args.command}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
