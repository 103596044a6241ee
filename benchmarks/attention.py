"""The decode attention kernel (kernels/triton_attention.py) alone on the Llama-3.1-8B shape (32 query heads, 8 KV
heads, head dim 128, 16-token pages): one step of B sequences of L cached keys each, over a bf16 cache and an FP8
cache in these layouts and kernels:

    fp8                  values by rows, as the keys
    fp8-values-by-slots  values transposed within their pages (the engine's layout for an FP8 cache)
    fp8-scales-by-slots  the same with the keys' and values' scales transposed within their pages too
    fp8-keys-first       values by slots, the keys and values first in the products (TileConfig.keys_first)
    fp8-dot              values by slots, products on FP8 tensor cores (fp8_dot: queries and probabilities in FP8)
    fp8-warp-split       values and scales by slots, each tile in a slice of keys a warp (TileConfig.warp_split)
    fp8-per-tensor       values by slots, one scale for all keys and one for all values (fp8_scales per_tensor):
                         no scale read a key, the scales on the scores and the output

and two variants of bf16 and of fp8-per-tensor:

    ...-keys-by-heads    the keys stored head by head within their pages ([block, head, slot, D] in memory), so that
                         a program reads a head's keys of a page as one run (2 KB in FP8), not 16 rows 1 KB apart
                         (bf16: its values too, with the keys' strides)
    ...-heads-first      the launch grid's fastest dimension is the KV head (TileConfig.heads_first): a sequence's
                         heads run side by side and read the same pages together

and fp8-values-by-slots-128-registers: the engine's FP8 layout with row scales, its threads capped at 128 registers
(TileConfig.max_registers; 140 uncapped on sm_90), so that 4 programs fit an SM, not 3; fp8-per-tensor-keys-first:
per-tensor scales with the keys and values first in the products (the queries padded to 8 rows, not 16; sm_90 at
2 warps and 64 keys: 16.9 warp instructions a key against the default tiles' 25.1, of them 45 register moves a tile
against 181, the queries read from shared memory as the products' second operand, not moved into the first's
register quads); fp8-scales-by-slots-keys-first: the same with row scales by slots (the engine's per-token cache;
20.6 a key against 28.7).

Each is timed per call, with the rate at which it reads the cache (keys, values and an FP8 cache's scales). With
--sweep, each kind is also timed under every tile configuration of a small grid (keys a tile, warps, stages), to
choose decode_config's.

    python benchmarks/attention.py                        # B 512, L 1024 (the FP8 throughput workload's steps)
    python benchmarks/attention.py --batch 64 --context 4096 --sweep

Each timing replays a CUDA graph of calls; the cache (GBs) is far larger than the L2, as in a real step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
KINDS = ("bf16", "fp8", "fp8-values-by-slots", "fp8-scales-by-slots", "fp8-keys-first", "fp8-dot",
         "fp8-warp-split", "fp8-per-tensor", "bf16-keys-by-heads", "bf16-heads-first", "fp8-per-tensor-keys-by-heads",
         "fp8-per-tensor-heads-first", "fp8-values-by-slots-128-registers", "fp8-per-tensor-keys-first",
         "fp8-scales-by-slots-keys-first")
# kind suffix: the TileConfig field it sets, and its value
VARIANTS = {"-heads-first": ("heads_first", True), "-128-registers": ("max_registers", 128),
            "-keys-first": ("keys_first", True)}


def _variant(kind: str, config, cache: torch.Tensor):
    """The tiles of `kind`: `config` (else the default for the cache), with the TileConfig field its suffix sets."""
    from raylm.kernels.triton_attention import decode_config

    for suffix, (field, value) in VARIANTS.items():
        if kind.endswith(suffix):
            return dataclasses.replace(config or decode_config(HEAD_DIM, 2, cache.element_size()), **{field: value})
    return config


def _by_heads(cache: torch.Tensor) -> torch.Tensor:
    """`cache` ([blocks, page, heads, D]) copied into memory laid out [blocks, heads, page, D], seen in its shape."""
    blocks, page, heads, dims = cache.shape
    return torch.empty((blocks, heads, page, dims), dtype=cache.dtype, device=cache.device).permute(0, 2, 1, 3) \
        .copy_(cache)


def _cases(batch: int, context: int, seed: int):
    """q, the block tables (each sequence's pages scattered over the cache) and the context lengths."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    pages = context // PAGE
    tables = torch.randperm(batch * pages, device="cuda", generator=generator).to(torch.int32).view(batch, pages)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1024, help="cached keys per sequence (a multiple of 16)")
    parser.add_argument("--calls", type=int, default=4, help="calls per CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time each kind under a grid of tiles")
    parser.add_argument("--sweep_warps", type=int, nargs="+", default=[1, 2, 4, 8], help="warps a program in the grid")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds to time")
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py times CUDA kernels: it needs a GPU")
    if args.context % PAGE:
        parser.error(f"--context must be a multiple of {PAGE}")
    from raylm.kernels import triton_kv_cache
    from raylm.kernels.attention_tiles import TileConfig
    from raylm.kernels.fp8 import FP8_MAX, quantize_fp8, quantize_fp8_by
    from raylm.kernels.triton_attention import decode_config, paged_decode_attention

    q, tables, lens = _cases(args.batch, args.context, seed=0)
    blocks = args.batch * args.context // PAGE
    shape = (blocks, PAGE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    (k8, k_scale), (v8, v_scale) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    v8_by_slots = triton_kv_cache.value_cache_by_slots(shape, v8.dtype, v8.device)
    v8_by_slots.view(torch.uint8).copy_(v8.view(torch.uint8))
    scales_by_slots = tuple(triton_kv_cache.scales_by_slots(scale.shape, scale.device).copy_(scale)
                            for scale in (k_scale, v_scale))
    tensor_scales = tuple((cache.float().abs().amax() / FP8_MAX).reshape(1) for cache in (k_cache, v_cache))
    k8_tensor = quantize_fp8_by(k_cache, tensor_scales[0])
    v8_tensor = triton_kv_cache.value_cache_by_slots(shape, v8.dtype, v8.device)
    v8_tensor.view(torch.uint8).copy_(quantize_fp8_by(v_cache, tensor_scales[1]).view(torch.uint8))
    caches = {"bf16": ((k_cache, v_cache), ()), "fp8": ((k8, v8), (k_scale, v_scale)),
              "fp8-values-by-slots": ((k8, v8_by_slots), (k_scale, v_scale)),
              "fp8-scales-by-slots": ((k8, v8_by_slots), scales_by_slots),
              "fp8-keys-first": ((k8, v8_by_slots), (k_scale, v_scale)),
              "fp8-dot": ((k8, v8_by_slots), (k_scale, v_scale)),
              "fp8-warp-split": ((k8, v8_by_slots), scales_by_slots),
              "fp8-per-tensor": ((k8_tensor, v8_tensor), tensor_scales),
              "bf16-keys-by-heads": ((_by_heads(k_cache), _by_heads(v_cache)), ()),
              "bf16-heads-first": ((k_cache, v_cache), ()),
              "fp8-per-tensor-keys-by-heads": ((_by_heads(k8_tensor), v8_tensor), tensor_scales),
              "fp8-per-tensor-heads-first": ((k8_tensor, v8_tensor), tensor_scales),
              "fp8-values-by-slots-128-registers": ((k8, v8_by_slots), (k_scale, v_scale)),
              "fp8-per-tensor-keys-first": ((k8_tensor, v8_tensor), tensor_scales),
              "fp8-scales-by-slots-keys-first": ((k8, v8_by_slots), scales_by_slots)}
    keys = args.batch * args.context * KV_HEADS
    result: dict = {"batch": args.batch, "context": args.context}
    scale = HEAD_DIM ** -0.5

    def timed(kind: str, config: TileConfig | None) -> dict:
        (k, v), scales = caches[kind]
        if kind == "fp8-keys-first":
            config = dataclasses.replace(config or decode_config(HEAD_DIM, 2, 1), keys_first=True)
        if kind == "fp8-warp-split":
            config = dataclasses.replace(config or decode_config(HEAD_DIM, 2, 1), warp_split=True)
        config = _variant(kind, config, k)
        nbytes = 2 * keys * HEAD_DIM * k.element_size() + (2 * keys * 4 if scales and scales[0].dim() > 1 else 0)

        def call():
            return paged_decode_attention(q, k, v, tables, lens, scale, kv_scales=scales, config=config,
                                          fp8_dot=kind == "fp8-dot")

        call()  # compiles outside the capture
        micros = graph_call_us(lambda: [call() for _ in range(args.calls)], args.calls)
        entry = {"us": micros, "tb_per_s": nbytes / micros / 1e6}
        label = "default" if config is None else (f"block_n {config.block_n}, warps {config.num_warps}, "
                                                  f"stages {config.num_stages}")
        print(f"{kind:<20} {label:<32} {micros:9.1f} us  {entry['tb_per_s']:.2f} TB/s", flush=True)
        return {"config": label, **entry}

    reference = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    fp8_out = paged_decode_attention(q, k8, v8, tables, lens, scale, kv_scales=(k_scale, v_scale))
    by_slots = paged_decode_attention(q, k8, v8_by_slots, tables, lens, scale, kv_scales=(k_scale, v_scale))
    scales_by_slots_out = paged_decode_attention(q, k8, v8_by_slots, tables, lens, scale, kv_scales=scales_by_slots)
    fp8_dot = paged_decode_attention(q, k8, v8_by_slots, tables, lens, scale, kv_scales=(k_scale, v_scale),
                                     fp8_dot=True)
    warp_split = paged_decode_attention(q, k8, v8_by_slots, tables, lens, scale, kv_scales=scales_by_slots,
                                        config=dataclasses.replace(decode_config(HEAD_DIM, 2, 1), warp_split=True))
    per_tensor = paged_decode_attention(q, k8_tensor, v8_tensor, tables, lens, scale, kv_scales=tensor_scales)
    variants_gap = 0.0
    for kind, base in (("bf16-keys-by-heads", reference), ("bf16-heads-first", reference),
                       ("fp8-per-tensor-keys-by-heads", per_tensor), ("fp8-per-tensor-heads-first", per_tensor),
                       ("fp8-values-by-slots-128-registers", by_slots), ("fp8-per-tensor-keys-first", per_tensor),
                       ("fp8-scales-by-slots-keys-first", scales_by_slots_out)):
        (k, v), scales = caches[kind]
        out = paged_decode_attention(q, k, v, tables, lens, scale, kv_scales=scales, config=_variant(kind, None, k))
        variants_gap = max(variants_gap, (out.float() - base.float()).abs().max().item())
    # every tile is whole here (L a multiple of the tiles): the same sums, their order up to the compiler (a bf16 ulp)
    if variants_gap > 2e-3:
        sys.exit(f"keys by heads, heads first, a register cap or the keys first changed the outputs (largest gap "
                 f"{variants_gap})")
    gap = (fp8_out.float() - reference.float()).abs().max().item()
    tensor_gap = (per_tensor.float() - reference.float()).abs().max().item()
    dot_gap = (fp8_dot.float() - reference.float()).abs().max().item()
    layouts_gap = max((out.float() - fp8_out.float()).abs().max().item()
                      for out in (by_slots, scales_by_slots_out, warp_split))
    if layouts_gap > 0.01:
        sys.exit(f"the FP8 cache's values (or scales) by slots, or the tiles in slices a warp, gave other outputs "
                 f"than by rows (largest gap {layouts_gap})")
    print(f"B {args.batch} x L {args.context}: FP8 cache against bf16, largest output gap {gap:.4f}; values by "
          f"slots (and warp slices) against by rows {layouts_gap:.4f}; FP8 products (fp8_dot) against bf16 "
          f"{dot_gap:.4f}; per-tensor scales against bf16 {tensor_gap:.4f}", flush=True)
    result["fp8_max_gap_vs_bf16"] = gap
    result["fp8_dot_max_gap_vs_bf16"] = dot_gap
    result["fp8_per_tensor_max_gap_vs_bf16"] = tensor_gap
    assert tuple(caches) == KINDS
    kinds = args.kinds
    for kind in kinds:
        result[kind] = timed(kind, None)
    if args.sweep:
        for kind in [kind for kind in kinds if kind != "fp8-keys-first"]:
            # the FP8 MMA takes 64 keys at a time, on a warpgroup (4 warps); a warp's slice at least 16
            tiles = {"fp8-dot": (64, 128), "fp8-warp-split": (64, 128, 256)}.get(kind, (32, 64, 128))
            warps_grid = [warps for warps in args.sweep_warps if kind != "fp8-dot" or warps >= 4]
            result[f"{kind}_sweep"] = [timed(kind, TileConfig(block_m=16, block_n=block_n, num_warps=warps,
                                                              num_stages=stages))
                                       for block_n in tiles for warps in warps_grid for stages in (2, 3)
                                       if kind != "fp8-warp-split" or block_n % (16 * warps) == 0]
            best = min(result[f"{kind}_sweep"], key=lambda entry: entry["us"])
            print(f"fastest {kind} tiles: {best['config']} ({best['tb_per_s']:.2f} TB/s)")
    path = write_result(f"attention-decode-llama-3.1-8b-b{args.batch}-l{args.context}", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
