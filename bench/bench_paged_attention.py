"""Decode paged attention on CUDA: the Triton kernel against the torch reference, in achieved GB/s.

Usage: python bench/bench_paged_attention.py [--batch 32] [--context 1024] [--heads 32] [--kv-heads 8] ...
       [--tree-nodes N]   every sequence verifies a draft tree of N nodes (N + 1 new tokens, ancestor masks) instead
                          of decoding one token: the kernel's tree masks against the reference's
       [--window W]       a sliding window of W positions: only the K/V tiles of the window are read

Decode attention is memory-bound: each step reads every cached K and V once, B * L * KVH * Dh * 2 * bytes
(32 x 1024 x 8 x 128 x 2 x 2 B = 134 MB for bf16), against ~4.8 TB/s of HBM on an H200 (~28 us at peak). q, the
output and the block tables are < 0.1% of that and are left out. Timings come from triton.testing.do_bench, which
clears the L2 cache between runs, so the K/V really come from HBM.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install

from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def decode_batch(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, tree_nodes: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode step: every sequence holds `context` positions, its blocks scattered over the cache; with
    tree_nodes, the last tree_nodes + 1 of them are a draft tree being verified (node i's parent: (i - 1) // 2,
    a binary tree)."""
    per_seq = (context + block_size - 1) // block_size
    num_blocks = batch * per_seq
    g = torch.Generator(device="cpu").manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g).view(batch, per_seq).to(device)       # [B, MB]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)  # [NB, BS, KVH, Dh]
    v_cache = torch.randn_like(k_cache)
    n = tree_nodes + 1                                                                        # new tokens each
    q = torch.randn(batch * n, heads, head_dim, device=device, dtype=dtype)                   # [T, H, Dh]
    pos = torch.arange(context - n, context, device=device)                                   # [n]
    slots = (tables[:, pos // block_size] * block_size + pos % block_size).flatten()          # [T]
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(0, batch * n + 1, n, dtype=torch.int64, device=device),
        num_decodes=batch if n == 1 else 0, query_lens=[n] * batch, seq_lens_host=[context] * batch,
        max_query_len=n,
    )
    if tree_nodes:
        from shared.tree import ancestor_mask

        mask = ancestor_mask([(i - 1) // 2 for i in range(tree_nodes)], device)                  # [n, n]
        meta.tree_masks = {b: mask for b in range(batch)}
    return q, k_cache, v_cache, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--tree-nodes", type=int, default=0, help="verify a draft tree of N nodes per sequence (0: decode)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128], help="KV tile sizes to try")
    ap.add_argument("--window", type=int, default=0, help="sliding window of this many positions (0: none)")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM bandwidth to compare with (H200: 4800)")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention needs a CUDA GPU (none found); on CPU the kernel only runs in the Triton "
                 "interpreter, see tests/unit/test_paged_attention_triton.py")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET to benchmark the compiled kernel")
    import triton.testing

    from shared.ops.paged_attention_triton import paged_attention_triton

    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    q, k_cache, v_cache, meta = decode_batch(args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                                             args.block_size, dtype, dev, args.tree_nodes)
    scale = args.head_dim ** -0.5
    window = args.window or None
    read = min(args.context, args.window + args.tree_nodes) if window else args.context   # positions a row set reads
    kv_bytes = 2 * args.batch * read * args.kv_heads * args.head_dim * k_cache.element_size()
    what = f"verify {args.tree_nodes}-node trees" if args.tree_nodes else "decode"
    what += f", window {args.window}" if window else ""
    print(f"{torch.cuda.get_device_name()}: {what} B={args.batch} L={args.context} H={args.heads} "
          f"KVH={args.kv_heads} Dh={args.head_dim} BS={args.block_size} {args.dtype}; K/V read {kv_bytes / 1e6:.1f} MB")

    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, window)                       # [T, H, Dh]
    runs: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("torch reference", partial(paged_attention_ref, q, k_cache, v_cache, meta, scale, window))]
    for bn in args.block_n:
        run = partial(paged_attention_triton, q, k_cache, v_cache, meta, scale, block_n=bn, window=window)
        err = (run().float() - ref.float()).abs().max().item()
        print(f"  triton block_n={bn}: max |out - ref| = {err:.2e}")
        runs.append((f"triton block_n={bn}", run))
    for name, fn in runs:
        ms = triton.testing.do_bench(fn, warmup=25, rep=200)
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        print(f"  {name:<22} {ms * 1e3:8.1f} us  {gbs:8.0f} GB/s  ({100 * gbs / args.peak_gbs:5.1f}% of "
              f"{args.peak_gbs:.0f} GB/s)")


if __name__ == "__main__":
    main()
