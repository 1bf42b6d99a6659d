"""`upesi generate "prompt"`: streams an answer from a running stack to the terminal."""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the question (sent as a user chat message unless --raw)")
    p.add_argument("--address", default=os.environ.get("UPESI_ADDRESS", "127.0.0.1:50051"),
                   help="router address (env UPESI_ADDRESS)")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")


def main(args: argparse.Namespace) -> None:
    import grpc

    from upesi.v1 import generation_pb2 as pb
    from upesi.v1 import generation_pb2_grpc

    req = pb.GenerateRequest(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    if args.raw:
        req.prompt = args.prompt
    else:
        if args.system:
            req.messages.add(role="system", content=args.system)
        req.messages.add(role="user", content=args.prompt)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(req, name, getattr(args, name))
    with grpc.insecure_channel(args.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        text = ""                                      # the answer so far (its end decides the final newline)
        try:
            for msg in stub.GenerateStream(req, timeout=args.timeout):
                for c in msg.choices:
                    sys.stdout.write(c.text)
                    text = (text + c.text)[-1:]
                sys.stdout.flush()
                if msg.HasField("usage"):
                    u = msg.usage
                    _end_line(text)
                    text = "\n"
                    print(f"[{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens]", file=sys.stderr)
        except grpc.RpcError as e:
            _end_line(text)
            print(f"upesi generate: {e.code().name}: {e.details()}", file=sys.stderr)
            sys.exit(1)
        _end_line(text)


def _end_line(text: str) -> None:
    """Ends the answer on stdout with a newline, unless it already ends with one (or is empty)."""
    if text and not text.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
