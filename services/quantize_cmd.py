"""`upesi quantize [MODEL] --out DIR`: writes a compressed-tensors NVFP4 checkpoint that `upesi serve --model DIR`
(and vLLM) load as it is."""
from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or a Hugging Face folder (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--out", required=True, help="output folder (created; files in it are overwritten)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4"], help="checkpoint format")
    p.add_argument("--policy", default=None,
                   help="per-layer precision: a JSON/YAML file mapping layer-name patterns to "
                        "nvfp4|fp8|bf16|fp32, or 'auto' (needs --memory-budget). Default: every linear NVFP4, "
                        "lm_head and embeddings bf16")
    p.add_argument("--memory-budget", default=None,
                   help="with --policy auto: total weight memory, e.g. 130MB or 0.2GiB; the layers with the "
                        "largest measured NVFP4 error are kept in bf16 while it fits")
    p.add_argument("--keep-precision", default="bf16", choices=["bf16", "fp8", "fp32"],
                   help="with --policy auto: the precision the most sensitive layers are kept in")
    p.add_argument("--lm-head", default=None, choices=["nvfp4", "fp8", "bf16", "fp32"],
                   help="the LM head's precision, over --policy (default bf16). A quantised head is written apart "
                        "from the embeddings (untied): NVFP4 reads 3.6x fewer bytes a token, the largest single "
                        "layer of small models; vLLM expects a high-precision head")
    p.add_argument("--act-quant", action="store_true",
                   help="W4A4: calibrate static activation scales (input_global_scale) and write an NVFP4 "
                        "(not NVFP4A16) config")
    p.add_argument("--calibration", default=None,
                   help="text file for calibration (auto policy, --act-quant); default: a built-in English text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from shared.convert.quantize import quantize

    text = None
    if args.calibration:
        with open(args.calibration) as f:
            text = f.read()
    result = quantize(args.model, args.out, policy=args.policy, memory_budget=args.memory_budget,
                      keep=args.keep_precision, act_quant=args.act_quant, calibration=text,
                      progress=not args.no_progress, lm_head=args.lm_head)
    print(result.report())
