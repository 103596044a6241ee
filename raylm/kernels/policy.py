"""Which kernels a model's layers run: the Triton ones or the torch reference, the decode GEMV or cuBLAS, and
whether the Triton decode kernels launch with programmatic dependent launch (kernels/pdl.py).

The model runner decides once, from `kernel_config`, the device and the model's size (`choose_kernel_policy`),
and hands the result to the model (`set_kernel_policy`); layers read the policy they were given, never a
process-wide switch, so two engines in one process can differ. The decode GEMV and PDL pay off where a decode step
streams its weights and cost where it waits on the host (docs/benchmarks.md), hence the default by model size.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from raylm.kernels.fp8 import FP8_CAPABILITY

# The most rows (tokens) the decode GEMV kernel takes; larger inputs are matmuls, left to cuBLAS.
GEMV_MAX_ROWS = 8
# kernel_config.pdl's values and the trigger mode each selects (the kernels' USE_PDL constexpr; 0 is off).
PDL_TRIGGERS = {"off": 0, "start": 1, "after_wait": 2, "exit": 3, "tail": 4}
# Weights per rank from which a decode step streams weights: ~1 ms of reading them at ~4 TB/s, about the host's own
# work for a step, below which the step waits on the host (Llama-3.1-8B: 16 GB at TP=1, 8 GB at TP=2, both measured
# faster with the GEMV and PDL; SmolLM2-135M: 0.27 GB, measured slower).
WEIGHT_STREAMING_BYTES = 4 << 30
# The trigger mode of weight-streaming models under pdl="auto" (measured best on the H200).
STREAMING_PDL_MODE = "tail"
_PDL_MIN_CAPABILITY = (9, 0)
_HALF = (torch.float16, torch.bfloat16)
# fp8_gemv_input settings under which the GEMVs after an RMSNorm take the FP8 rows it writes (INPUT_MODES "fp8"), and
# the input mode of the others (o, down), whose input comes as a tensor.
_HANDED_FP8_ROWS = {"fp8_rows": "float16", "fp8_tiles": "fp8_tiles"}
_FP8_INPUTS = ("fp8", *_HANDED_FP8_ROWS)  # the settings that need FP8 tensor cores


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (Triton's own TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class KernelPolicy:
    """The kernels of one model: `triton` for CUDA tensors (else the torch reference), `decode_gemv` for linear
    layers of at most GEMV_MAX_ROWS half-precision rows (`fp8_gemv_input`: how those on FP8 weights take their
    input), and `pdl`, the Triton kernels' trigger mode (0: plain launches). The default is the torch
    reference throughout."""

    triton: bool = False
    decode_gemv: bool = False
    pdl: int = 0
    fp8_gemv_input: str = "fp8_rows"  # how GEMVs on FP8 weights take their input (INPUT_MODES or _HANDED_FP8_ROWS)
    lora_beside: bool = False  # LoRA's products computed on a second stream beside the GEMV, added after it
    fp8_attention_dot: bool = False  # decode attention over an FP8 cache multiplies on FP8 tensor cores
    fp8_attention_slices: bool = False  # ... or widens, each tile in a slice of keys a warp (TileConfig.warp_split)
    fp8_attention_keys_first: bool = False  # ... or widens, the keys and values first in the products (keys_first)
    gemv_tiles: str = "shipped"  # the GEMV's tiles: shipped for the GPU model where known, else tuned (triton_gemv)
    gemv_prefetch: int = 0  # bytes of each weight row a GEMV program asks the L2 for before its PDL wait

    def on_triton(self, x: torch.Tensor) -> bool:
        """Whether an operation on x runs its Triton kernel."""
        return self.triton and x.is_cuda

    def gemv_input_mode(self, weight_scale: torch.Tensor | None, x=None) -> str:
        """How the GEMV takes its input x for a weight (triton_gemv.INPUT_MODES): fp8_gemv_input for an FP8 weight
        (one with a weight_scale), "model_dtype" for any other. Under "fp8_rows", "fp8" for FP8 rows handed over
        (kernels/fp8.py's Fp8Rows) and "float16" for a tensor; under "fp8_tiles", "fp8" and "fp8_tiles"."""
        if weight_scale is None:
            return "model_dtype"
        if self.fp8_gemv_input in _HANDED_FP8_ROWS:
            return _HANDED_FP8_ROWS[self.fp8_gemv_input] if isinstance(x, torch.Tensor) else "fp8"
        return self.fp8_gemv_input

    @property
    def gemv_takes_fp8_rows(self) -> bool:
        """Whether GEMVs on FP8 weights take FP8 rows that the kernel before them wrote (Fp8Rows)."""
        return self.fp8_gemv_input in _FP8_INPUTS

    def gemv_applies(self, x, weight: torch.Tensor) -> bool:
        """Whether x @ weight.T goes to the Triton GEMV: a few rows of half-precision input on CUDA, the weight in
        x's dtype or in FP8; or a few FP8 rows quantized before (kernels/fp8.py's Fp8Rows) for an FP8 weight whose
        GEMV takes them (gemv_takes_fp8_rows)."""
        if not self.decode_gemv:
            return False
        if not isinstance(x, torch.Tensor):  # Fp8Rows
            return (self.gemv_takes_fp8_rows and weight.dtype == torch.float8_e4m3fn
                    and x.values.is_cuda and x.values.shape[0] <= GEMV_MAX_ROWS)
        return (x.is_cuda and x.dtype in _HALF and (weight.dtype == x.dtype or weight.dtype == torch.float8_e4m3fn)
                and x.numel() <= GEMV_MAX_ROWS * x.shape[-1])


def set_kernel_policy(model: torch.nn.Module, policy: KernelPolicy) -> None:
    """Hands `policy` to every layer of `model` that chooses kernels (those with a `kernels` attribute)."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = policy


def streams_weights(weight_bytes: int) -> bool:
    """Whether a model of weight_bytes per rank streams weights in its decode steps (WEIGHT_STREAMING_BYTES)."""
    return weight_bytes >= WEIGHT_STREAMING_BYTES


def choose_kernel_policy(device: torch.device, weight_bytes: int, triton: bool = True,
                         decode_gemv: bool | None = None, pdl: str = "auto",
                         fp8_gemv_input: str = "fp8_rows", lora_expand: str = "beside",
                         fp8_attention: str = "float16", gemv_tiles: str = "shipped",
                         gemv_prefetch: int = 0) -> KernelPolicy:
    """The policy for a model of `weight_bytes` per rank on `device`, from kernel_config's fields: Triton where asked
    for, on CUDA, and importable; the GEMV (decode_gemv None) and PDL (pdl "auto") for models that stream weights; PDL
    only on compute capability 9.0+ and never interpreted; LoRA's products on a second stream beside the GEMV where
    lora_expand is "beside" (else by a kernel after it); FP8 products in the decode attention over an FP8 cache where
    fp8_attention is "fp8", tiles in slices a warp where it is "float16_slices", the keys and values first in the
    products where it is "float16_keys_first"; the GEMV's tiles as gemv_tiles says
    (kernels/gemv_tiles.py); gemv_prefetch bytes of each weight row asked of the L2 before a GEMV's PDL wait, where PDL
    is on. FP8 inputs to the GEMV (fp8_gemv_input "fp8", "fp8_rows" or "fp8_tiles") need FP8 tensor cores (compute
    capability 8.9+); below that the GEMV takes float16."""
    if pdl != "auto" and pdl not in PDL_TRIGGERS:
        raise ValueError(f"kernel_config.pdl must be 'auto' or one of {sorted(PDL_TRIGGERS)}, got {pdl!r}")
    on_triton = triton and device.type == "cuda" and triton_available()
    if not on_triton:
        return KernelPolicy()
    if fp8_gemv_input in _FP8_INPUTS and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        fp8_gemv_input = "float16"
    streaming = streams_weights(weight_bytes)
    mode = PDL_TRIGGERS[(STREAMING_PDL_MODE if streaming else "off") if pdl == "auto" else pdl]
    if mode and (triton_interpreted() or torch.cuda.get_device_capability(device) < _PDL_MIN_CAPABILITY):
        mode = 0
    return KernelPolicy(triton=True, decode_gemv=streaming if decode_gemv is None else decode_gemv, pdl=mode,
                        fp8_gemv_input=fp8_gemv_input, lora_beside=lora_expand == "beside",
                        fp8_attention_dot=fp8_attention == "fp8",
                        fp8_attention_slices=fp8_attention == "float16_slices",
                        fp8_attention_keys_first=fp8_attention == "float16_keys_first", gemv_tiles=gemv_tiles,
                        gemv_prefetch=gemv_prefetch if mode else 0)
