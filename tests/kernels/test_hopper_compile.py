"""The decode kernels compile for Hopper (sm_90) on a machine without a GPU: Triton's ahead-of-time compile to
PTX and ptxas, so a kernel change that only a GPU would fail to build (types, layouts, constexpr branches) fails
here first. The variants are the ones an H200 runs: bf16 and FP8 weights (either operand order), split K, LoRA in
the epilogue (computed there, or loaded, computed before the GEMV)."""

from __future__ import annotations

import pytest

from tests.kernels import INTERPRETED

pytestmark = [pytest.mark.slow,  # about 40 s of compiling: run before a GPU session (`pytest -m slow` on this file)
              pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces the kernels it would compile")]
triton = pytest.importorskip("triton")

HOPPER = None if INTERPRETED else triton.backends.compiler.GPUTarget("cuda", 90, 32)
POINTERS = {"x_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_ptr": "*bf16", "bias_ptr": "*bf16", "scale_ptr": "*fp32",
            "y_ptr": "*bf16", "partial_ptr": "*fp32", "arrivals_ptr": "*i32", "b_ptr": "*bf16",
            "slot_ptr": "*i32", "out_ptr": "*bf16"}
FP8 = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv"}


# Integer arguments that a model's layers pass as multiples of 16, which Triton's launcher marks as such (as it
# marks every pointer 16-byte aligned): the loads' vector widths follow from these marks.
MULTIPLES_OF_16 = {"N", "K", "stride_xm", "stride_wn", "stride_ym", "head_dim", "stride_qb", "stride_qh", "stride_ob",
                   "stride_oh", "stride_block", "stride_slot", "stride_head", "stride_kt", "stride_kh", "stride_vt",
                   "stride_vh", "stride_scale_block", "stride_v_block", "stride_v_slot", "stride_v_head",
                   "stride_v_dim"}


def compile_for_hopper(kernel, constexprs: dict, pointers: dict | None = None, num_warps: int = 4,
                       num_stages: int = 3, asm: str = "ptx", max_registers: int = 0) -> str:
    """The kernel's PTX (or another of Triton's stages, `asm`) for sm_90, its pointer arguments typed by POINTERS
    (and `pointers`), the rest int32, marked as the launcher would mark a model's arguments; `constexprs` the
    kernel does not take are left out, and those it takes but are not given take their defaults (left out, they
    would compile as runtime arguments, their branches as runtime branches). max_registers: ptxas's cap a thread
    (maxnreg; 0: none)."""
    from triton.compiler import ASTSource

    types = {**POINTERS, **(pointers or {})}
    defaults = {param.name: param.default for param in kernel.params if param.is_constexpr and param.has_default}
    constexprs = {name: value for name, value in {**defaults, **constexprs}.items() if name in kernel.arg_names}
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
             if name not in constexprs and (signature[name].startswith("*") or name in MULTIPLES_OF_16)}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers:
        options["maxnreg"] = max_registers
    return triton.compile(source, target=HOPPER, options=options).asm[asm]


GEMV = {"HAS_BIAS": False, "HAS_SCALE": False, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "USE_PDL": 0,
        "X_MODE": 0, "SWAP_AB": 0, "CORE": 0}


@pytest.mark.parametrize("split_k", [1, 2])
def test_the_decode_gemv_compiles_for_hopper(split_k):
    from raylm.kernels.triton_gemv import _gemv_kernel

    ptx = compile_for_hopper(_gemv_kernel, {**GEMV, "SPLIT_K": split_k})
    assert ".target sm_90" in ptx and "mma" in ptx


@pytest.mark.parametrize("x_mode", [0, 1, 2, 3])
@pytest.mark.parametrize("swap_ab", [0, 1])
def test_the_fp8_gemvs_compile_for_hopper(x_mode, swap_ab):
    from raylm.kernels.triton_gemv import _gemv_kernel, _gemv_silu_mul_kernel

    fp8 = {**GEMV, "HAS_SCALE": True, "BLOCK_K": 512, "X_MODE": x_mode, "SWAP_AB": swap_ab}
    pointers = FP8 if x_mode == 2 else {"w_ptr": "*fp8e4nv"}
    assert ".target sm_90" in compile_for_hopper(_gemv_kernel, {**fp8, "SPLIT_K": 1}, pointers)
    assert ".target sm_90" in compile_for_hopper(_gemv_silu_mul_kernel, fp8, pointers)


def test_fp8_rows_meet_64_weight_rows_first_on_the_fp8_warpgroup_product_split_or_not():
    """FP8 x (from the norm, or quantized) against 64 FP8 weight rows first, K split in two or not: Hopper's FP8
    warpgroup product (wgmma ... e4m3.e4m3), as the tuning offers it for one row and for eight."""
    from raylm.kernels.triton_gemv import _gemv_kernel

    tiles = {**GEMV, "HAS_SCALE": True, "BLOCK_N": 64, "BLOCK_K": 512, "X_MODE": 2, "SWAP_AB": 1}
    for split_k in (1, 2):
        ptx = compile_for_hopper(_gemv_kernel, {**tiles, "SPLIT_K": split_k}, FP8)
        assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx, split_k


def test_fp8_tiles_quantize_x_for_the_fp8_warpgroup_product_in_fewer_instructions_a_byte():
    """X_MODE 3 (fp8_gemv_input "fp8_tiles", o's and down's input as a tensor): each 128-wide tile of x quantized in
    the loop and multiplied by 128 FP8 weight rows first on Hopper's FP8 warpgroup product, at under a third of the
    one-row CUDA-core loop's instructions a weight byte (sm_90: 2.2 against 7.0), no spills."""
    from raylm.kernels.triton_gemv import _gemv_kernel

    weights = {"w_ptr": "*fp8e4nv"}
    tiles = {**GEMV, "HAS_SCALE": True, "SPLIT_K": 1, "BLOCK_N": 128, "BLOCK_K": 128, "X_MODE": 3, "SWAP_AB": 1}
    core = {**GEMV, "HAS_SCALE": True, "SPLIT_K": 1, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "X_MODE": 1,
            "CORE": 1, "CORE_AHEAD": 1}
    assert "QGMMA" in _cuobjdump(_gemv_kernel, tiles, weights, "-sass", num_stages=4)
    assert "STACK:0" in _cuobjdump(_gemv_kernel, tiles, weights, "-res-usage", num_stages=4)
    (tile_loop,) = _loop_instructions(_gemv_kernel, tiles, weights, num_stages=4)
    (core_loop,) = _loop_instructions(_gemv_kernel, core, weights, num_stages=1)
    per_byte = tile_loop / (128 * 128 / 128), core_loop / (16 * 512 / 128)  # a thread's share of the tile
    assert per_byte[0] < per_byte[1] / 3, per_byte


@pytest.mark.parametrize("x_mode", [0, 1, 2])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("ahead", [1, 2])
def test_the_one_row_fp8_gemvs_compile_for_hopper(x_mode, split_k, ahead):
    """CORE: one row of x against FP8 weights on the CUDA cores, no tensor-core instructions; its weight tiles in
    16-byte loads, CORE_AHEAD tiles ahead."""
    from raylm.kernels.triton_gemv import _gemv_kernel

    core = {**GEMV, "HAS_SCALE": True, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "X_MODE": x_mode, "CORE": 1,
            "CORE_AHEAD": ahead}
    pointers = FP8 if x_mode == 2 else {"w_ptr": "*fp8e4nv"}
    ptx = compile_for_hopper(_gemv_kernel, {**core, "SPLIT_K": split_k}, pointers)
    assert ".target sm_90" in ptx and "mma" not in ptx and "ld.global.v4.b32" in ptx


@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp8_core"])
def test_the_gemvs_ask_the_l2_for_their_rows_before_the_pdl_wait(weights):
    """kernel_config.gemv_prefetch: each program asks the L2 for PREFETCH bytes of each of its weight rows (one
    prefetch a 128-byte line) before it waits on the kernel before it (griddepcontrol.wait)."""
    from raylm.kernels.triton_gemv import _gemv_kernel, _gemv_silu_mul_kernel

    flags = {**GEMV, "USE_PDL": 4, "PREFETCH": 2048, "SPLIT_K": 1}
    pointers = None
    if weights != "bf16":
        flags.update(HAS_SCALE=True, BLOCK_K=512, X_MODE=1)
        pointers = {"w_ptr": "*fp8e4nv"}
    if weights == "fp8_core":
        flags.update(BLOCK_M=1, BLOCK_N=16, CORE=1)
    kernels = [_gemv_kernel] if weights == "fp8_core" else [_gemv_kernel, _gemv_silu_mul_kernel]
    for kernel in kernels:
        ptx = compile_for_hopper(kernel, flags, pointers)
        assert "prefetch.global.L2" in ptx, kernel.__name__
        assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait"), kernel.__name__
        without = compile_for_hopper(kernel, {**flags, "PREFETCH": 0}, pointers)
        assert "prefetch.global.L2" not in without


def test_the_silu_mul_gemv_compiles_for_hopper():
    from raylm.kernels.triton_gemv import _gemv_silu_mul_kernel

    assert ".target sm_90" in compile_for_hopper(_gemv_silu_mul_kernel, GEMV)


def test_the_lora_kernels_compile_for_hopper():
    from raylm.kernels.triton_lora import _expand_kernel, _shrink_kernel

    assert ".target sm_90" in compile_for_hopper(_expand_kernel, {"PARTS": 3, "BLOCK_N": 128, "BLOCK_RANK": 16,
                                                                   "BLOCK_S": 16, "USE_PDL": 1})
    assert ".target sm_90" in compile_for_hopper(_expand_kernel, {"PARTS": 2, "BLOCK_N": 128, "BLOCK_RANK": 16,
                                                                   "BLOCK_S": 16, "USE_PDL": 1, "STORE": 1},
                                                 {"out_ptr": "*fp32"})
    assert ".target sm_90" in compile_for_hopper(_shrink_kernel, {"BLOCK_R": 16, "BLOCK_K": 128, "SPLIT": 256,
                                                                   "USE_PDL": 1}, {"x_ptr": "*bf16", "a_ptr": "*bf16",
                                                                                   "out_ptr": "*fp32"})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_lora_segment_kernels_compile_for_hopper(dtype):
    from raylm.kernels.triton_lora import _segment_expand_kernel, _segment_shrink_kernel

    precision = "ieee" if dtype == "fp32" else "tf32"
    marker = "mma" if dtype == "bf16" else ".target sm_90"  # float32 products stay exact, off the tensor cores
    types = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
             "blocks_ptr": "*i32"}
    assert marker in compile_for_hopper(_segment_shrink_kernel, {"BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_K": 64,
                                                                "SPLIT": 256, "DOT_PRECISION": precision},
                                       {**types, "out_ptr": "*fp32"})
    assert marker in compile_for_hopper(_segment_expand_kernel, {"BLOCK_M": 32, "BLOCK_RALL": 256, "BLOCK_N": 64,
                                                                "N_TILES": 4, "DOT_PRECISION": precision},
                                       {**types, "partial_ptr": "*fp32"})


ATTENTION = {"q_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "out_ptr": "*bf16",
             "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "k_ptr": "*bf16",
             "v_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_mapping_ptr": "*i64",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32"}
FP8_ATTENTION = {**ATTENTION, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
# The engine's decode tile over an FP8 cache (values by slots, 128 keys, the rotation inside, one split), with the
# Llama-3.1-8B group: the tests add KV_FP8 (1 row scales, 2 per tensor) and what they vary.
FP8_DECODE_TILE = {"GROUP": 4, "BLOCK_G": 16, "BLOCK_D": 128, "BLOCK_N": 128, "PAGE_SIZE": 16, "DIRECT_OUTPUT": True,
                   "DOT_PRECISION": "tf32", "ROPE": True, "USE_PDL": 0, "stride_v_slot": 1, "V_BY_SLOTS": True,
                   "V_RUN": 16}


@pytest.mark.parametrize("rope", [False, True])
def test_the_fp8_cache_decode_attention_widens_its_tiles_to_float16(rope):
    """An FP8 cache's tiles meet bf16 queries in float16: one conversion per two values (cvt e4m3x2 to f16x2),
    none of the one-value float16-to-bfloat16 conversions that widening to bfloat16 adds per value."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs = {"GROUP": 4, "BLOCK_G": 16, "BLOCK_D": 128, "BLOCK_N": 64, "PAGE_SIZE": 16, "DIRECT_OUTPUT": True,
                  "DOT_PRECISION": "tf32", "ROPE": rope, "KV_FP8": True, "USE_PDL": 0, "V_BY_SLOTS": False,
                  "V_RUN": 16}
    pointers = FP8_ATTENTION
    ptx = compile_for_hopper(_decode_split_kernel, constexprs, pointers)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx and "mma" in ptx


@pytest.mark.parametrize("rope", [False, True])
def test_fp8_values_transposed_within_their_pages_reach_the_tensor_cores_without_one_byte_shared_loads(rope):
    """The FP8 value operand's reduction runs along keys. Values transposed within their pages (slot stride 1, which
    Triton's launcher specializes on) are contiguous that way: no thread assembles the operand from one-byte shared
    loads, as it does from values by rows (64 a tile with Triton 3.9), and, read in whole runs of 16 keys of a page,
    they load from memory 16 bytes at a time, not a byte."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs = {"GROUP": 4, "BLOCK_G": 16, "BLOCK_D": 128, "BLOCK_N": 64, "PAGE_SIZE": 16, "DIRECT_OUTPUT": True,
                  "DOT_PRECISION": "tf32", "ROPE": rope, "KV_FP8": True, "USE_PDL": 0, "stride_v_slot": 1,
                  "V_BY_SLOTS": True, "V_RUN": 16}
    pointers = FP8_ATTENTION
    ptx = compile_for_hopper(_decode_split_kernel, constexprs, pointers)
    assert "ld.shared.b8" not in ptx and "ld.global.b8" not in ptx and "mma" in ptx


def test_fp8_dot_multiplies_fp8_on_the_warpgroup_mma():
    """fp8_dot: keys and the values' transpose are the products' first operands, 64 rows at a time, so the FP8
    tiles reach Hopper's warpgroup MMA as they are stored, with no widening to 16 bits."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs = {"GROUP": 4, "BLOCK_G": 8, "BLOCK_D": 128, "BLOCK_N": 128, "PAGE_SIZE": 16, "DIRECT_OUTPUT": False,
                  "DOT_PRECISION": "tf32", "ROPE": True, "KV_FP8": True, "USE_PDL": 0, "stride_v_slot": 1,
                  "V_BY_SLOTS": True, "V_RUN": 16, "FP8_DOT": True, "KEYS_FIRST": True}
    pointers = FP8_ATTENTION
    ptx = compile_for_hopper(_decode_split_kernel, constexprs, pointers)
    assert "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3" in ptx and "mma.sync" not in ptx
    assert "cvt.rn.f16x2.e4m3x2" not in ptx  # no tile widened


@pytest.mark.parametrize("keys_first", [False, True])
def test_an_fp8_tile_reduces_its_scores_and_value_scales_together(keys_first):
    """A tile's keys are spread over the warps, so each reduction over them is an exchange through shared memory
    with barriers: the scores' and the value scales' maxima share one, the probabilities' sum takes the other
    (sm_90, values by slots, 128 keys: 11 barriers a tile widening, 13 with FP8 products; 14 with three)."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs = {"GROUP": 4, "BLOCK_G": 8 if keys_first else 16, "BLOCK_D": 128, "BLOCK_N": 128, "PAGE_SIZE": 16,
                  "DIRECT_OUTPUT": True, "DOT_PRECISION": "tf32", "ROPE": True, "KV_FP8": True, "USE_PDL": 0,
                  "stride_v_slot": 1, "V_BY_SLOTS": True, "V_RUN": 16, "FP8_DOT": keys_first,
                  "KEYS_FIRST": keys_first}
    pointers = FP8_ATTENTION
    ir = compile_for_hopper(_decode_split_kernel, constexprs, pointers, asm="ttgir")
    loop = ir[ir.index("scf.for"):]
    assert loop.count('"tt.reduce"') == 2


def _cuobjdump(kernel, constexprs: dict, pointers: dict, what: str, max_registers: int = 0, num_warps: int = 4,
               num_stages: int = 3) -> str:
    """cuobjdump's `what` (-sass, -res-usage) of the kernel's sm_90 machine code (cuobjdump ships with Triton)."""
    import subprocess
    import tempfile
    from pathlib import Path

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compile_for_hopper(kernel, constexprs, pointers, num_warps, num_stages, asm="cubin",
                                       max_registers=max_registers))
        cubin.flush()
        return subprocess.run([tools / "cuobjdump", what, cubin.name], capture_output=True, text=True,
                              check=True).stdout


def _registers_and_instructions(kernel, constexprs: dict, pointers: dict) -> tuple[int, int]:
    """The sm_90 machine code's registers a thread and instruction count."""
    import re

    usage = _cuobjdump(kernel, constexprs, pointers, "-res-usage")
    sass = _cuobjdump(kernel, constexprs, pointers, "-sass")
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    return int(re.search(r"REG:(\d+)", usage).group(1)), instructions


def test_per_tensor_scales_take_the_fp8_decode_fewer_registers_and_instructions():
    """An FP8 cache with per-tensor scales (KV_FP8 2) reads no scale a key and weighs no probability by one: its
    decode tile is a 16-bit cache's once widened (sm_90, values by slots, 128 keys, 4 warps, 3 stages: 148
    registers and 1,912 instructions against 175 and 2,208 with a scale per row)."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs = {"GROUP": 4, "BLOCK_G": 16, "BLOCK_D": 128, "BLOCK_N": 128, "PAGE_SIZE": 16, "DIRECT_OUTPUT": False,
                  "DOT_PRECISION": "tf32", "ROPE": True, "USE_PDL": 0, "stride_v_slot": 1, "V_BY_SLOTS": True,
                  "V_RUN": 16}
    pointers = FP8_ATTENTION
    per_row = _registers_and_instructions(_decode_split_kernel, {**constexprs, "KV_FP8": 1}, pointers)
    per_tensor = _registers_and_instructions(_decode_split_kernel, {**constexprs, "KV_FP8": 2}, pointers)
    assert per_tensor[0] < per_row[0] and per_tensor[1] < 0.9 * per_row[1], (per_tensor, per_row)


def _loop_instructions(kernel, constexprs: dict, pointers: dict, num_warps: int = 4, num_stages: int = 3) -> list[int]:
    """The sm_90 machine code's instructions in each loop (a backward branch's span)."""
    import re

    lines = _cuobjdump(kernel, constexprs, pointers, "-sass", num_warps=num_warps, num_stages=num_stages).splitlines()
    addresses = [int(match.group(1), 16) for line in lines if (match := re.match(r"\s+/\*([0-9a-f]{4,})\*/", line))]
    loops = [(int(match.group(2), 16), int(match.group(1), 16)) for line in lines
             if (match := re.match(r"\s+/\*([0-9a-f]{4,})\*/.*BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", line))]
    return [sum(start <= address <= end for address in addresses) for start, end in loops if start < end]


def test_decode_tiles_of_heads_that_fill_them_fit_four_programs_an_sm():
    """EVEN_D (head_dim a power of 2, as the launcher sets it): the default decode tile (values by slots, 128 keys, 4
    warps, per-tensor scales) without a mask on the head's dimensions (sm_90: 802 instructions a tile against 836,
    128 registers against 150), so that 4 programs fit an SM, not 3: 10% faster on an H200 (docs/benchmarks.md)."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs, pointers = {**FP8_DECODE_TILE, "KV_FP8": 2}, FP8_ATTENTION
    (masked,) = _loop_instructions(_decode_split_kernel, constexprs, pointers)
    (even,) = _loop_instructions(_decode_split_kernel, {**constexprs, "EVEN_D": True}, pointers)
    assert even < masked, (even, masked)
    registers = _registers_and_instructions(_decode_split_kernel, {**constexprs, "EVEN_D": True}, pointers)[0]
    assert registers <= 65536 // (4 * 128), registers


def test_a_register_cap_fits_four_fp8_row_scale_programs_an_sm():
    """TileConfig.max_registers: the default decode tile over an FP8 cache with row scales (values by slots, 128 keys,
    4 warps) takes 140 registers (3 programs an SM); capped at 128 it fits 4, spilling a few bytes at most."""
    import re

    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs, pointers = {**FP8_DECODE_TILE, "KV_FP8": 1, "EVEN_D": True}, FP8_ATTENTION
    usage = {cap: _cuobjdump(_decode_split_kernel, constexprs, pointers, "-res-usage", max_registers=cap)
             for cap in (0, 128)}
    registers = {cap: int(re.search(r"REG:(\d+)", text).group(1)) for cap, text in usage.items()}
    assert registers[0] > 128 >= registers[128], registers
    assert int(re.search(r"STACK:(\d+)", usage[128]).group(1)) <= 32, usage[128]


@pytest.mark.parametrize("kv_fp8", [1, 2], ids=["row-scales", "tensor-scales"])
def test_keys_first_tiles_take_fewer_instructions_a_key(kv_fp8):
    """keys_first_config (kernel_config.fp8_attention 'float16_keys_first'): the keys and values first in the
    products, 2 warps, 64 keys, the queries the second operand (padded to 8). sm_90, the decode loop's warp
    instructions a key: 16.9 against the default tiles' 25.1 with per-tensor scales, 20.6 against 28.7 with row
    scales; no spills."""
    import re

    from raylm.kernels.triton_attention import _decode_split_kernel, decode_config, keys_first_config

    pointers = FP8_ATTENTION
    default, keys_first = decode_config(128, 2, 1), keys_first_config(128)
    constexprs = {**FP8_DECODE_TILE, "KV_FP8": kv_fp8, "EVEN_D": True}
    first = {**constexprs, "KEYS_FIRST": True, "BLOCK_G": 8, "BLOCK_N": keys_first.block_n}
    (queries_first_loop,) = _loop_instructions(_decode_split_kernel, {**constexprs, "BLOCK_N": default.block_n},
                                               pointers, default.num_warps, default.num_stages)
    (keys_first_loop,) = _loop_instructions(_decode_split_kernel, first, pointers, keys_first.num_warps,
                                            keys_first.num_stages)
    per_key = (queries_first_loop * default.num_warps / default.block_n,
               keys_first_loop * keys_first.num_warps / keys_first.block_n)
    assert per_key[1] < 0.8 * per_key[0], per_key
    usage = _cuobjdump(_decode_split_kernel, first, pointers, "-res-usage", num_warps=keys_first.num_warps,
                       num_stages=keys_first.num_stages)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage


def test_warp_split_tiles_give_each_warp_a_slice_of_keys():
    """warp_split: the products are batched over the tile's slices with one warp each (the MMA's warps along the
    batch), so that the softmax's reductions over keys stay within a warp; keys and values still load through
    asynchronous copies (sm_90: 4 barriers a 128-key tile, against 11 for the tile spread over the warps)."""
    from raylm.kernels.triton_attention import _decode_split_kernel

    constexprs, pointers = {**FP8_DECODE_TILE, "KV_FP8": True, "WARP_SPLIT": 4}, FP8_ATTENTION
    ir = compile_for_hopper(_decode_split_kernel, constexprs, pointers, asm="ttgir")
    assert "versionMajor = 2" in ir and "warpsPerCTA = [4, 1, 1]" in ir
    ptx = compile_for_hopper(_decode_split_kernel, constexprs, pointers)
    assert "cp.async.cg.shared.global" in ptx and "ld.global.b8" not in ptx


@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_writing_fp8_rows_compiles_for_hopper(residual):
    """rms_norm_fp8: the row's amax, scale and FP8 bytes stored in the norm's own program."""
    from raylm.kernels.triton_ops import _rms_norm_kernel

    ptx = compile_for_hopper(_rms_norm_kernel, {"HAS_RESIDUAL": residual, "BLOCK": 4096, "QUANTIZE": True},
                             {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv",
                              "residual_out_ptr": "*bf16", "scale_ptr": "*fp32", "eps": "fp32"}, num_warps=16)
    assert ".target sm_90" in ptx and "e4m3" in ptx


def test_the_norm_adding_lora_products_compiles_for_hopper():
    """fused_add_rms_norm with extra (a LoRA layer's products left to the norm): one more float32 row loaded."""
    from raylm.kernels.triton_ops import _rms_norm_kernel

    ptx = compile_for_hopper(_rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096, "HAS_EXTRA": True,
                                                "USE_PDL": 4},
                             {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
                              "residual_out_ptr": "*bf16", "scale_ptr": "*fp32", "extra_ptr": "*fp32",
                              "eps": "fp32"}, num_warps=16)
    assert ".target sm_90" in ptx and "griddepcontrol.wait" in ptx


def test_silu_and_mul_writing_fp8_rows_compiles_for_hopper():
    from raylm.kernels.triton_ops import _silu_and_mul_fp8_kernel

    ptx = compile_for_hopper(_silu_and_mul_fp8_kernel, {"BLOCK": 16384},
                             {"gate_up_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, num_warps=16)
    assert ".target sm_90" in ptx and "e4m3" in ptx


def test_silu_and_mul_adding_lora_products_compiles_for_hopper():
    from raylm.kernels.triton_ops import _silu_and_mul_kernel

    ptx = compile_for_hopper(_silu_and_mul_kernel, {"BLOCK": 1024, "USE_PDL": 1, "HAS_EXTRA": True},
                             {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "extra_ptr": "*fp32"})
    assert ".target sm_90" in ptx and "griddepcontrol.wait" in ptx
