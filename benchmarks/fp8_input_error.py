"""How much each way of rounding a decode GEMV's input costs the layer's output, on a real model's activations: the
inputs of every o and down projection (RowParallelLinear) of SmolLM2-135M-Instruct (the embedded default, fp32, CPU)
over 16 prompts and 32 greedy tokens each, multiplied by the layer's weight after rounding them each way, against the
unrounded product: the relative error ||x' W^T - x W^T|| / ||x W^T||, mean and largest over the calls, per layer
kind. The ways: float16 (fp8_gemv_input "fp8_rows"' o and down), FP8 with a scale per token (the "fp8" mode, the
FP8 matmul), and per row and block of 128 values of K, the amax put on 448 ("fp8_tiles", triton_fp8.tile_scale) or
a power of two instead (microscaling's kind of scale).

    python benchmarks/fp8_input_error.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.accuracy import PROMPTS  # noqa: E402
from benchmarks.common import write_result  # noqa: E402

BLOCK = 128  # triton_gemv.FP8_TILE_K


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, -x.shape[1] % BLOCK)).reshape(x.shape[0], -1, BLOCK)


def _unblocked(blocks: torch.Tensor, k: int) -> torch.Tensor:
    return blocks.reshape(blocks.shape[0], -1)[:, :k]


def _float16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504, 65504).half().float()


def _per_token(x: torch.Tensor) -> torch.Tensor:
    from raylm.kernels.fp8 import dequantize_fp8, quantize_fp8

    return dequantize_fp8(*quantize_fp8(x))


def _tiles(x: torch.Tensor) -> torch.Tensor:
    from raylm.kernels.fp8 import FP8_DTYPE

    blocks = _blocks(x)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-60)
    inverse = torch.full_like(amax, 448.0) / amax
    return _unblocked((blocks * inverse).to(FP8_DTYPE).float() * (amax * torch.tensor(1 / 448.0)), x.shape[1])


def _tiles_power_of_two(x: torch.Tensor) -> torch.Tensor:
    from raylm.kernels.fp8 import FP8_DTYPE

    blocks = _blocks(x)
    mantissa, exponent = torch.frexp(blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-60))
    scale = torch.ldexp(torch.ones_like(mantissa), exponent - 9 + (mantissa > 0.875).int())
    return _unblocked((blocks / scale).to(FP8_DTYPE).float() * scale, x.shape[1])


WAYS = {"float16": _float16, "fp8 per token": _per_token, "fp8_tiles": _tiles,
        "fp8 blocks, power-of-two scales": _tiles_power_of_two}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    from raylm import LLM, SamplingParams
    from raylm.models import parallel

    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = parallel.RowParallelLinear.forward

    def recorded(self, x, *rest, **options):
        if isinstance(x, torch.Tensor):
            calls.append((x.detach().reshape(-1, x.shape[-1]).float().clone(), self.weight.detach().float()))
        return forward(self, x, *rest, **options)

    parallel.RowParallelLinear.forward = recorded
    try:
        with LLM(executor="local", device="cpu") as llm:
            llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)
    finally:
        parallel.RowParallelLinear.forward = forward
    result: dict = {"calls": len(calls)}
    for k in sorted({x.shape[1] for x, _ in calls}):
        kind = f"K={k}"
        for way, rounded in WAYS.items():
            errors = torch.tensor([((rounded(x) - x) @ w.T).norm().item() / (x @ w.T).norm().clamp(min=1e-30).item()
                                   for x, w in calls if x.shape[1] == k])
            result.setdefault(kind, {})[way] = {"mean": errors.mean().item(), "max": errors.max().item()}
            print(f"{kind:7s} {way:32s} relative output error: mean {errors.mean():.3e}  max {errors.max():.3e}")
    print(f"wrote {write_result('fp8-input-error-smollm2', args, result)}")


if __name__ == "__main__":
    main()
