"""The FlashInfer backend's steps (FlashInferPlanner's plans, then attend) against the torch reference, built the
way the Triton kernels' tests build them: random caches and block assignments, decodes, prefill chunks over
cached prefixes, mixed steps, sliding windows. Runs where CUDA and flashinfer are available."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("flashinfer")

from raylm.kernels.flashinfer_backend import FlashInferPlanner  # noqa: E402
from tests.kernels.test_triton_attention import PREFILL_CHUNKS, Shape, _run_step  # noqa: E402

DEVICE = torch.device("cuda")
# The shapes the engine tests and benchmarks meet (each kernel variant is compiled on first use, which takes
# FlashInfer's JIT about a minute): grouped queries (tensor-core decode), one query per KV head (CUDA-core
# decode), the Llama-3.1-8B shape.
SHAPES = [Shape(16, 2, 4, 64), Shape(16, 4, 1, 64), Shape(16, 8, 4, 128)]


def _planner(shape: Shape, dtype: torch.dtype) -> FlashInferPlanner:
    return FlashInferPlanner(shape.num_kv_heads * shape.group, shape.num_kv_heads, shape.head_dim,
                             shape.head_dim**-0.5, dtype, DEVICE)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_reference(shape):
    torch.manual_seed(11)
    _run_step(DEVICE, torch.bfloat16, shape, decode_lens=[1, 15, 16, 17, 100, 2049], prefill_chunks=[],
              planner=_planner(shape, torch.bfloat16))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_over_cached_prefixes_matches_reference(shape):
    torch.manual_seed(12)
    _run_step(DEVICE, torch.bfloat16, shape, decode_lens=[], prefill_chunks=PREFILL_CHUNKS,
              planner=_planner(shape, torch.bfloat16))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mixed_steps_on_one_planner_match_reference(shape):
    """Successive steps on one planner rotate over its wrapper sets; each must match its own reference."""
    torch.manual_seed(13)
    planner = _planner(shape, torch.bfloat16)
    steps = [([3, 33, 400], [(0, 20), (48, 17)]), ([1], []), ([], [(0, 300)]), ([5, 6, 7, 8], [(16, 1)]),
             ([2000], [(100, 64), (0, 2)])]
    for decode_lens, chunks in steps:
        _run_step(DEVICE, torch.bfloat16, shape, decode_lens=decode_lens, prefill_chunks=chunks, planner=planner)


@pytest.mark.parametrize("sliding_window", [1, 100])
def test_sliding_window_hides_old_keys(sliding_window):
    torch.manual_seed(14)
    shape = Shape(16, 2, 2, 64)
    _run_step(DEVICE, torch.bfloat16, shape, decode_lens=[1, 17, 300], prefill_chunks=[(0, 90), (30, 45)],
              sliding_window=sliding_window, planner=_planner(shape, torch.bfloat16))
