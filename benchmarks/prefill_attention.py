"""The prefill attention kernel (kernels/triton_prefill_attention.py) alone on the Llama-3.1-8B shape (32 query heads,
8 KV heads, head dim 128, 16-token pages): S chunks of L new tokens each, from position 0 (causal over their own
keys, read back from the paged cache), over a bf16 cache and over an FP8 cache stored as the engine stores it
(values and scales by slots). Each is timed at prefill_config's tiles and, with --sweep, under other tiles, with
the rate in TFLOP/s of the causal products (2 x 2 x D per query head and visible key).

    python benchmarks/prefill_attention.py                  # S 8 x L 1024 (a step of max_num_tokens 8192)
    python benchmarks/prefill_attention.py --sweep

The FP8 cache's default tiles are bf16's (prefill_config goes by the queries' size): 255 registers with spills on
sm_90, by ptxas. The sweep's tiles are those that compile without spills or with fewer (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# (block_m, block_n, num_warps, num_stages) timed beside the default
SWEEP = ((128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024, help="new tokens per sequence (a multiple of 16)")
    parser.add_argument("--calls", type=int, default=2, help="calls per CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time each cache under the SWEEP tiles")
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/prefill_attention.py times CUDA kernels: it needs a GPU")
    if args.length % PAGE:
        parser.error(f"--length must be a multiple of {PAGE}")
    from raylm.kernels import triton_kv_cache
    from raylm.kernels.attention_tiles import TileConfig
    from raylm.kernels.fp8 import quantize_fp8
    from raylm.kernels.triton_prefill_attention import paged_prefill_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    pages = args.length // PAGE
    blocks = args.seqs * pages
    tables = torch.randperm(blocks, device="cuda", generator=generator).to(torch.int32).view(args.seqs, pages)
    tokens = args.seqs * args.length
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    starts = torch.arange(args.seqs + 1, device="cuda", dtype=torch.int32) * args.length
    seq_starts = torch.zeros(args.seqs, device="cuda", dtype=torch.int32)
    lens = torch.full((args.seqs,), args.length, device="cuda", dtype=torch.int32)
    shape = (blocks, PAGE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    (k8, k_scale), (v8, v_scale) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    v8_by_slots = triton_kv_cache.value_cache_by_slots(shape, v8.dtype, v8.device)
    v8_by_slots.view(torch.uint8).copy_(v8.view(torch.uint8))
    scales = tuple(triton_kv_cache.scales_by_slots(scale.shape, scale.device).copy_(scale)
                   for scale in (k_scale, v_scale))
    caches = {"bf16": (k_cache, v_cache, ()), "fp8": (k8, v8_by_slots, scales)}
    visible = args.seqs * args.length * (args.length + 1) // 2 * Q_HEADS
    flops = 4 * HEAD_DIM * visible
    scale = HEAD_DIM ** -0.5

    def attend(kind: str, config):
        k, v, kv_scales = caches[kind]
        return paged_prefill_attention(q, k, v, tables, starts, seq_starts, lens, scale, kv_scales=kv_scales,
                                       config=config)

    defaults = {kind: attend(kind, None) for kind in caches}
    gap = (defaults["fp8"].float() - defaults["bf16"].float()).abs().max().item()
    print(f"S {args.seqs} x L {args.length}: FP8 cache against bf16, largest output gap {gap:.4f}", flush=True)
    result: dict = {"seqs": args.seqs, "length": args.length, "fp8_max_gap_vs_bf16": gap}

    def timed(kind: str, tiles: tuple | None) -> dict:
        config = None if tiles is None else TileConfig(*tiles)
        if config is not None:  # each tiling's output against the default's: the same sums in another order
            tile_gap = (attend(kind, config).float() - defaults[kind].float()).abs().max().item()
            if tile_gap > 0.05:
                sys.exit(f"{kind} under tiles {tiles} gave other outputs than the default (largest gap {tile_gap})")
        micros = graph_call_us(lambda: [attend(kind, config) for _ in range(args.calls)], args.calls)
        entry = {"us": micros, "tflop_per_s": flops / micros / 1e6,
                 "config": "default" if tiles is None else "block_m {}, block_n {}, warps {}, stages {}".format(*tiles)}
        print(f"{kind:<6} {entry['config']:<40} {micros:9.1f} us  {entry['tflop_per_s']:6.1f} TFLOP/s", flush=True)
        return entry

    for kind in caches:
        result[kind] = timed(kind, None)
        if args.sweep:
            result[f"{kind}_sweep"] = [timed(kind, tiles) for tiles in SWEEP]
            best = min(result[f"{kind}_sweep"], key=lambda entry: entry["us"])
            print(f"fastest {kind} tiles: {best['config']} ({best['tflop_per_s']:.1f} TFLOP/s)")
    path = write_result(f"attention-prefill-llama-3.1-8b-s{args.seqs}-l{args.length}", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
