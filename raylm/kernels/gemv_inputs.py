"""What the decode GEMV (kernels/triton_gemv.py) takes as its input: the input modes of a GEMV on FP8 weights, and
the checks of x, the weight and its scales, with x quantized per row where the mode says so (once for every program
of the GEMV) or handed over already quantized (Fp8Rows, as the RMSNorm before qkv and gate / up writes them)."""

from __future__ import annotations

import torch

from raylm.kernels.fp8 import FP8_DTYPE, Fp8Rows
from raylm.kernels.policy import GEMV_MAX_ROWS
from raylm.kernels.triton_fp8 import quantize_rows_fp8

# How a GEMV on FP8 weights takes its input (its kernels' X_MODE): "model_dtype" widens the weight to the input's
# dtype, "float16" multiplies both in float16, "fp8" quantizes the input to FP8 per row, "fp8_tiles" per row and
# triton_gemv.FP8_TILE_K values of K.
INPUT_MODES = {"model_dtype": 0, "float16": 1, "fp8": 2, "fp8_tiles": 3}


def _check_weight(weight: torch.Tensor, weight_scale: torch.Tensor | None, name: str, input_mode: str) -> None:
    """Checks a GEMV's weight, an FP8 weight's scales (one float32 per weight row) and the input mode."""
    fp8 = weight.dtype == FP8_DTYPE
    if weight.dtype not in (torch.float16, torch.bfloat16, FP8_DTYPE):
        raise TypeError(f"{name} takes a float16, bfloat16 or float8_e4m3fn weight, got {weight.dtype}")
    if fp8 != (weight_scale is not None):
        raise ValueError(f"{name}: weight_scale goes with a float8_e4m3fn weight and only with one")
    if input_mode not in INPUT_MODES:
        raise ValueError(f"{name}: input_mode must be one of {sorted(INPUT_MODES)}, got {input_mode!r}")
    if input_mode != "model_dtype" and not fp8:
        raise ValueError(f"{name}: input_mode {input_mode!r} goes with a float8_e4m3fn weight")
    if fp8 and (weight_scale.dtype != torch.float32 or weight_scale.shape != weight.shape[:1]
                or not weight_scale.is_contiguous()):
        raise ValueError(f"{name}: weight_scale must be contiguous float32 of shape [{weight.shape[0]}], got "
                         f"{weight_scale.dtype} {list(weight_scale.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError(f"{name} needs a weight whose rows are contiguous")


def _check_rows(rows: torch.Tensor, name: str) -> torch.Tensor:
    """rows [M, K] after checking M, with a contiguous last dimension."""
    if rows.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"{name} takes at most {GEMV_MAX_ROWS} rows, got {rows.shape[0]}")
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _input_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, name: str,
                input_mode: str = "model_dtype") -> torch.Tensor:
    """x as [M, K] rows with a contiguous last dimension, after checking x, weight and an FP8 weight's scales for a
    GEMV."""
    _check_weight(weight, weight_scale, name, input_mode)
    fp8 = weight.dtype == FP8_DTYPE
    fits = x.dtype in (torch.float16, torch.bfloat16) if fp8 else x.dtype == weight.dtype
    if x.shape[-1] != weight.shape[1] or not fits:
        raise ValueError(f"x of shape {list(x.shape)} and dtype {x.dtype} does not fit a weight of shape "
                         f"{list(weight.shape)} and dtype {weight.dtype}")
    return _check_rows(x.reshape(-1, weight.shape[1]), name)


def _quantized(rows: torch.Tensor, input_mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The GEMV's input rows as its input mode takes them: with "fp8", quantized per row (FP8 rows, their float32
    scales), once for every program of the GEMV."""
    if input_mode == "fp8" and rows.shape[0]:
        return quantize_rows_fp8(rows)
    return rows, None


def gemv_input(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor | None, name: str,
                input_mode: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype, tuple[int, ...]]:
    """(rows [M, K] as the kernel reads them, their FP8 scales or None, the output's dtype, x's leading shape). x
    may come quantized already (Fp8Rows: the RMSNorm before the layer wrote them), in the "fp8" input mode only;
    else it is checked and, in that mode, quantized here."""
    if not isinstance(x, Fp8Rows):
        rows = _input_rows(x, weight, weight_scale, name, input_mode)
        return (*_quantized(rows, input_mode), x.dtype, tuple(x.shape[:-1]))
    if input_mode != "fp8":
        raise ValueError(f"{name} takes FP8 rows (Fp8Rows) in input_mode 'fp8' only, got {input_mode!r}")
    _check_weight(weight, weight_scale, name, input_mode)
    values, scale = x.values, x.scale
    if values.dtype != FP8_DTYPE or values.dim() != 2 or values.shape[1] != weight.shape[1] \
            or scale.dtype != torch.float32 or tuple(scale.shape) != values.shape[:1] or not scale.is_contiguous():
        raise ValueError(f"{name}: FP8 rows for a weight of shape {list(weight.shape)} need float8_e4m3fn values "
                         f"[M, {weight.shape[1]}] and contiguous float32 scales [M], got {values.dtype} "
                         f"{list(values.shape)} and {scale.dtype} {list(scale.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: FP8 rows stand for float16 or bfloat16 rows, got {x.dtype}")
    return _check_rows(values, name), scale, x.dtype, tuple(values.shape[:-1])
