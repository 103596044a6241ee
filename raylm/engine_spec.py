"""What the driver tells the workers before the engine starts (WorkerSpec), what it learns once the engine is up
(EngineInfo), and how 'auto' devices and dtypes resolve.

Nothing here imports torch when the module is imported: the HTTP ingress, which never computes, uses these too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raylm.config import LlmArgs
from raylm.models.source import ModelSource
from raylm.pooling import PoolingSpec

if TYPE_CHECKING:
    import torch

    from raylm.models.quantization import Fp8Weights


@dataclass
class WorkerSpec:
    """What a worker needs to build its part of the engine; picklable."""

    args: LlmArgs
    source: ModelSource
    device: str
    dtype: str
    max_seq_len: int
    cpu_threads: int | None = None  # torch threads of a CPU worker (None: torch's default)
    pooling: PoolingSpec | None = None  # set for an encode_only engine (no KV cache; engine/pooling_engine.py)
    fp8: Fp8Weights | None = None  # FP8 linear weights (models/quantization.py), from quant_config and the checkpoint
    draft_source: ModelSource | None = None  # speculative decoding's draft model (DraftTargetDecodingConfig)


@dataclass
class EngineInfo:
    """What the driver learns about the engine at start-up."""

    num_blocks: int
    block_size: int
    max_seq_len: int
    vocab_size: int
    device: str
    dtype: str
    startup_metrics: dict = field(default_factory=dict)
    pooling: PoolingSpec | None = None  # an encode_only engine's pooling; None for one that generates


def resolve_device(requested: str) -> str:
    """'auto' is 'cuda' where the engine's workers will find GPUs, else 'cpu'; asking for 'cuda' where there
    are none is an error. The workers' GPUs are the Ray cluster's when this process is connected to one (its
    own may be none: a driver or a Serve replica holds no GPU), else this machine's."""
    if requested not in ("auto", "cuda"):
        return requested
    has_gpus = _gpus_available()
    if requested == "auto":
        return "cuda" if has_gpus else "cpu"
    if not has_gpus:
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return requested


def _gpus_available() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def resolve_dtype(requested: str, device: str, config_dtype: torch.dtype | None) -> str:
    """'auto' is float32 on the CPU (exact and fast there); on a GPU, the checkpoint's half type."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    import torch

    return "float16" if config_dtype == torch.float16 else "bfloat16"
