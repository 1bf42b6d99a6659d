"""The `upesi` command line."""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """Upesi: LLM inference as gRPC microservices.

  upesi serve                 start the whole stack (router, target, optional draft and expert shards) here
  upesi generate "prompt"     stream an answer from a running stack
  upesi router|target|...     start one service (what compose and Kubernetes run)

Every flag also reads an UPESI_* environment variable (e.g. --max-num-seqs <- UPESI_MAX_NUM_SEQS)."""


def build_parser() -> argparse.ArgumentParser:
    from services import launcher
    from services.draft import main as draft
    from services.experts import main as experts
    from services.router import main as router
    from services.target import main as target
    from services import generate_cmd, quantize_cmd, train_draft_cmd

    p = argparse.ArgumentParser(prog="upesi", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="INFO", help="logging level of the services (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, module) -> None:
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(func=module.main)

    add("serve", "start the stack as child processes: router, targets, optional draft and expert shards", launcher)
    add("generate", "stream an answer from a running stack", generate_cmd)
    add("quantize", "write an NVFP4 (compressed-tensors) checkpoint of a model", quantize_cmd)
    add("router", "run the router: public gRPC API (and HTTP /health, /metrics)", router)
    add("target", "run a target: model, paged KV cache, continuous batching", target)
    add("experts", "run an expert shard: the FFN weights placed on it, stateless batched compute", experts)
    add("draft", "run a draft service: drives speculative decoding with a target over a Verify stream (n-gram, "
        "a small draft model or an EAGLE head)", draft)
    add("train-draft", "train an EAGLE-style draft head for a target by self-distillation", train_draft_cmd)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from shared.rpc.server import setup_logging

    setup_logging(args.log_level)
    try:
        args.func(args)
    except ValueError as e:          # config validation: a clear line, not a traceback
        print(f"upesi {args.command}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
