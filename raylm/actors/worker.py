"""A worker: one per device. It loads its shard of the model, owns the KV cache, and on rank 0 hosts the
engine core. The in-process executor runs one directly; the Ray executor wraps it in an actor."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from raylm.config import LlmArgs
from raylm.engine.engine_core import EngineCore, EngineLimits
from raylm.engine.model_runner import ModelRunner
from raylm.models.loader import load_hf_config, load_model
from raylm.models.source import ModelSource

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without a max_tokens setting, a CPU engine gives its KV cache this many bytes.
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


@dataclass
class WorkerSpec:
    """What a worker needs to build its part of the engine; picklable."""

    args: LlmArgs
    source: ModelSource
    device: str
    dtype: str
    max_seq_len: int
    rank: int = 0


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


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return requested


def resolve_dtype(requested: str, device: str, config_dtype: torch.dtype | None) -> str:
    """'auto' is float32 on the CPU (exact and fast there); on a GPU, the checkpoint's half type."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    return "float16" if config_dtype == torch.float16 else "bfloat16"


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = _DTYPES[spec.dtype]
        self.timings: dict[str, dict[str, float]] = {}
        self.engine: EngineCore | None = None
        self.runner: ModelRunner | None = None

    def report_device_id(self) -> str:
        """The GPU's UUID on CUDA; on the CPU a stable id of this host and process."""
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return f"cpu-{uuid.getnode():012x}-{os.getpid()}"

    def start(self) -> EngineInfo:
        """Loads the model, sizes and allocates the KV cache, and builds the engine core."""
        begin = time.perf_counter()
        args = self.spec.args
        hf_config = load_hf_config(self.spec.source, args.trust_remote_code)
        loaded = load_model(self.spec.source, hf_config, self.dtype, self.device, self.spec.max_seq_len,
                            args.load_format, seed=args.seed)
        model_built = time.perf_counter()
        kv_config = args.kv_cache_config
        self.runner = ModelRunner(loaded.model, loaded.arch, self.device, self.dtype, kv_config.tokens_per_block,
                                  seed=args.seed)
        kv_dtype = self.dtype if kv_config.dtype == "auto" else _DTYPES[kv_config.dtype]
        num_blocks = self._num_blocks(kv_dtype)
        self.runner.allocate_kv_cache(num_blocks, kv_dtype)
        kv_ready = time.perf_counter()
        self.engine = EngineCore(self.runner, EngineLimits(
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            max_seq_len=self.spec.max_seq_len,
            block_size=kv_config.tokens_per_block,
            num_blocks=num_blocks,
            enable_block_reuse=kv_config.enable_block_reuse,
            enable_chunked_prefill=args.enable_chunked_prefill,
            event_buffer_max_size=kv_config.event_buffer_max_size,
            iter_stats_max_iterations=args.iter_stats_max_iterations,
        ))
        done = time.perf_counter()
        self.timings = {
            "model_loader": loaded.timings,
            "py_executor": {
                "model_engine_creation_seconds": model_built - begin,
                "kv_cache_capacity_configuration_seconds": kv_ready - model_built,
                "final_kv_cache_creation_seconds": kv_ready - model_built,
                "worker_start_seconds": done - kv_ready,
                "total_py_executor_creation_seconds": done - begin,
            },
        }
        return EngineInfo(num_blocks, kv_config.tokens_per_block, self.spec.max_seq_len, loaded.arch.vocab_size,
                          self.spec.device, self.spec.dtype, self.timings)

    def _num_blocks(self, kv_dtype: torch.dtype) -> int:
        kv_config = self.spec.args.kv_cache_config
        block_size = kv_config.tokens_per_block
        per_block = self.runner.kv_bytes_per_block(kv_dtype)
        token_cap = -(-kv_config.max_tokens // block_size) if kv_config.max_tokens else None
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            memory_cap = int(free * (kv_config.free_gpu_memory_fraction or 0.9)) // per_block - 1  # null block
            num_blocks = min(memory_cap, token_cap) if token_cap is not None else memory_cap
        else:
            num_blocks = token_cap if token_cap is not None else DEFAULT_CPU_KV_BYTES // per_block - 1
        if num_blocks < 1:
            raise ValueError(f"the KV cache does not fit: one block needs {per_block} bytes")
        return num_blocks
