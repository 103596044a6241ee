"""Validated configuration of an engine: `LlmArgs` and its sub-configs.

Everything a user can set on `LLM(...)` is checked here, once, at the edge; the engine receives typed
objects and never re-validates.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"


class StrictModel(BaseModel):
    """A pydantic model that rejects unknown fields, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class KvCacheConfig(StrictModel):
    """How large the paged KV cache is and how it is shared between requests."""

    free_gpu_memory_fraction: float | None = Field(
        default=0.9, gt=0.0, le=1.0,
        description="Fraction of the GPU memory left free after loading the model that the KV cache takes.",
    )
    max_tokens: int | None = Field(
        default=None, ge=1,
        description="Upper bound on the number of tokens the cache holds (the CPU capacity; a cap on GPU).",
    )
    enable_block_reuse: bool = Field(default=True, description="Prefix caching: reuse blocks of equal prefixes.")
    tokens_per_block: int = Field(default=32, ge=1, le=1024, description="Tokens per KV cache block.")
    event_buffer_max_size: int = Field(default=0, ge=0, description="KV cache events kept for get_kv_cache_events.")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = Field(
        default="auto", description="What the cache stores keys and values in. auto: the model's dtype. fp8: "
                                    "float8_e4m3fn with a float32 scale per token and head (about 1/2 of bf16's "
                                    "bytes, 1/4 of float32's); on the triton and torch attention backends.")
    fp8_scales: Literal["auto", "per_token", "per_tensor"] = Field(
        default="auto",
        description="How an FP8 cache scales what it stores. per_token: each token's key and value of each head by "
                    "its own amax / 448, a float32 beside its row (needs no calibration, follows every outlier). "
                    "per_tensor: one static scale for a layer's keys and one for its values, the checkpoint's "
                    "(k_scale / v_scale of an FP8-KV checkpoint) or else 1.0 (values past ±448 saturate): no scale "
                    "stored or read per row, the faster to decode. auto: per_tensor where the checkpoint has "
                    "every layer's KV scales, else per_token.")


class SchedulerConfig(StrictModel):
    """Scheduling policy knobs beyond the batch limits."""

    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = Field(
        default="MAX_UTILIZATION",
        description="MAX_UTILIZATION admits requests while their prompts fit and preempts when decodes run out of "
                    "blocks; GUARANTEED_NO_EVICT admits a request only when blocks for its prompt and all of its "
                    "max_tokens are free beside those every running request may still need, so none is preempted.")


class CudaGraphConfig(StrictModel):
    """CUDA graphs for decode steps and short prefills (GPU only)."""

    batch_sizes: list[int] | None = Field(default=None, description="Batch sizes to capture (default: a ladder).")
    max_batch_size: int | None = Field(
        default=None, ge=1,
        description="Largest batch captured when batch_sizes is unset (default: the engine's max_batch_size).")
    capture_logits: bool = Field(
        default=True, description="Decode graphs also compute the logits and, for greedy requests, the draws; "
                                  "false launches them eagerly after the graph.")
    prefill_max_tokens: int = Field(
        default=256, ge=0,
        description="Steps with prompt tokens of at most this many rows in all (their decodes included) replay "
                    "graphs of their own, each prompt token a row that attends to its prefix as a decode does "
                    "(Triton attention only): a short prompt's prefill without the host's launches; 0: such steps "
                    "run eagerly.")

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 1):
            raise ValueError(f"cuda_graph_config.batch_sizes must be positive integers, got {value}")
        return value


class SleepConfig(StrictModel):
    """What AsyncLLM.release keeps of each memory tag (engine/device_memory.py). The KV cache is always discarded,
    the decode graphs captured again, the model's other device tensors copied to the host."""

    model_weights: Literal["host_copy", "discard"] = Field(
        default="host_copy", description="host_copy: a host copy (pinned on GPUs) restores the weights on resume; "
                                         "discard: nothing is kept, and update_weights refills them after resume.")
    keep_addresses: bool | None = Field(
        default=False, description="Weights, buffers and KV cache come back at the same device addresses "
                                   "(torch-memory-saver on CUDA, pip install 'raylm[rl]'), so resume captures no "
                                   "decode graphs again; false frees and reallocates them; null: kept where "
                                   "torch-memory-saver is installed.")


class KernelConfig(StrictModel):
    """Which kernels the model runs on a GPU. The defaults are the fastest measured on the H200
    (docs/benchmarks.md); each choice changes speed, never results beyond floating-point rounding."""

    triton: bool = Field(default=True, description="Triton kernels for CUDA tensors (attention, RMSNorm, RoPE, "
                                                   "SiLU-mul); false runs the torch reference throughout.")
    decode_gemv: bool | None = Field(
        default=None, description="Decode-sized linear layers (at most 8 rows) through the Triton GEMV instead of "
                                  "cuBLAS; null: on for models with at least 4 GiB of weights per rank, whose decode "
                                  "steps stream weights.")
    fp8_gemv_input: Literal["model_dtype", "float16", "fp8", "fp8_rows", "fp8_tiles"] = Field(
        default="fp8_rows", description="Decode GEMVs on FP8 weights: 'fp8_rows' (the default, the fastest at "
                                        "batch 1 and 8) takes FP8 where the RMSNorm before wrote it (qkv, gate / up) "
                                        "and float16 elsewhere (o, down), with no quantizer kernel; 'fp8_tiles' "
                                        "takes the RMSNorm's FP8 rows too, and quantizes o's and down's input in the "
                                        "GEMV, a scale per row and 128 values of K, for the FP8 tensor cores (not "
                                        "the default until timed); "
                                        "'float16' "
                                        "multiplies the weights widened to float16 with the activations rounded to "
                                        "float16; 'model_dtype' widens the weights to the activations' dtype; 'fp8' "
                                        "quantizes every layer's activations per token and multiplies FP8 by FP8. "
                                        "The FP8 modes need compute capability 8.9+; below it the GEMV takes float16.")
    lora_expand: Literal["kernel", "beside"] = Field(
        default="beside", description="Decode steps with LoRA adapters: 'beside' (the default, fastest on the H200 "
                                      "and the H100: docs/benchmarks.md) computes the adapters' products on a second "
                                      "CUDA stream while the layer's GEMV runs (a branch of the decode graph) and "
                                      "adds them to its output after; 'kernel' computes and adds them in kernels "
                                      "after the GEMV.")
    fp8_attention: Literal["float16", "float16_slices", "float16_keys_first", "fp8"] = Field(
        default="float16", description="Decode attention over an FP8 KV cache on the Triton backend: 'float16' widens "
                                       "the cached keys and values to float16 for the tensor cores; 'float16_slices' "
                                       "does too, each tile of keys cut into a slice a warp with a softmax state of "
                                       "its own (fewer exchanges between warps a tile); 'float16_keys_first' does "
                                       "too, the keys and values first in the products (the GQA group's queries "
                                       "padded to 8, not 16: fewer instructions a key); 'fp8' multiplies them as "
                                       "stored on FP8 tensor cores, the queries and the softmax's probabilities "
                                       "quantized to FP8 too (their rounding changes results more than float16's: "
                                       "docs/benchmarks.md; heads of fewer than 32 dimensions stay on float16).")
    gemv_tiles: Literal["shipped", "tune"] = Field(
        default="shipped", description="The decode GEMV's tiles per layer shape: 'shipped' launches those raylm ships "
                                       "for the GPU model (raylm/kernels/gemv_tiles.json, tuned with "
                                       "benchmarks/tune_gemv.py) where it has the shape, and times the candidates for "
                                       "the others at start-up; 'tune' times the candidates for every shape.")
    gemv_prefetch: int = Field(
        default=0, ge=0, le=16384, description="Bytes of each weight row (0, or a power of two from 128) that each "
                                               "program of a decode GEMV asks the L2 for before it waits on the "
                                               "kernels before it (under PDL): its weights then stream in while the "
                                               "small kernels between GEMVs run. 0 (the default): only its first tile; "
                                               "4096 measured slower (docs/benchmarks.md).")
    pdl: Literal["auto", "off", "start", "after_wait", "exit", "tail"] = Field(
        default="auto", description="Programmatic dependent launch of the Triton decode kernels (compute capability "
                                    "9.0+): when a kernel lets the next one start. auto: 'tail' for models whose "
                                    "decode steps stream weights, else off.")
    symmetric_memory_allreduce: bool | None = Field(
        default=None, description="Small tensor-parallel all-reduces through torch symmetric memory instead of NCCL; "
                                  "null: on for TP > 1 on CUDA (NCCL where symmetric memory is unavailable).")
    fused_allreduce_norm: bool | None = Field(
        default=None, description="The o / down projections leave their all-reduce to the RMSNorm after them, done "
                                  "in one kernel with the residual add on GPUs; null: on for TP > 1 on CUDA.")

    @field_validator("gemv_prefetch")
    @classmethod
    def _prefetch_power_of_two(cls, value: int) -> int:
        if value and (value < 128 or value & (value - 1)):
            raise ValueError(f"gemv_prefetch must be 0 or a power of two from 128 to 16384, got {value}")
        return value

    @field_validator("pdl", mode="before")
    @classmethod
    def _pdl_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` (--set kernel_config.pdl=off) as false


class PoolingConfig(StrictModel):
    """How an encode_only engine turns a prompt's hidden states into one embedding. Each field left unset comes from
    the model's sentence-transformers config (modules.json: its Pooling and Normalize modules), else from the
    defaults: mean pooling for encoder-only models, the last token for decoders (Qwen3-Embedding style), and
    normalized."""

    pooling_type: Literal["mean", "cls", "last"] | None = Field(
        default=None, description="mean: the average over the prompt's tokens; cls: the first token's hidden state; "
                                  "last: the last token's.")
    normalize: bool | None = Field(default=None, description="Scale each embedding to unit L2 norm.")
    matryoshka_dimensions: list[int] | None = Field(
        default=None, description="Sizes an embeddings request's `dimensions` may truncate to (Matryoshka "
                                  "representations); null: those the model's config.json gives (matryoshka_dimensions, "
                                  "or any size up to the hidden size where is_matryoshka is true), else none.")

    @field_validator("matryoshka_dimensions")
    @classmethod
    def _positive_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 1):
            raise ValueError(f"pooling_config.matryoshka_dimensions must be positive integers, got {value}")
        return value


class QuantConfig(StrictModel):
    """Quantization of the model (the LLM API's QuantConfig). quant_algo="FP8" stores each linear weight of the
    decoder layers as float8_e4m3fn with a float32 scale per output row and quantizes activations per token at run
    time; embeddings, the LM head, norms and biases stay in the model's dtype. A checkpoint already in FP8 (its
    config.json's quantization_config) implies it (models/quantization.py)."""

    quant_algo: Literal["FP8"] | None = Field(
        default=None, description="FP8: weights in float8_e4m3fn, quantized as they load unless the checkpoint holds "
                                  "them so already; null: the checkpoint's own (in the model's dtype unless "
                                  "quantized).")
    kv_cache_quant_algo: Literal["FP8"] | None = Field(
        default=None, description="FP8: an FP8 KV cache, as kv_cache_config.dtype='fp8' (either may say it).")
    weight_scale: Literal["per_channel", "per_tensor"] = Field(
        default="per_channel", description="How weights quantized at load time are scaled: per_channel, by their "
                                           "output row's amax / 448; per_tensor, by their matrix's. A checkpoint in "
                                           "FP8 keeps its own scales.")


class NGramDecodingConfig(StrictModel):
    """Speculative decoding by prompt lookup (the LLM API's NGramDecodingConfig): each step proposes up to
    max_draft_len tokens that followed the latest earlier occurrence of the sequence's last n tokens (n from
    max_matching_ngram_size down to 1) in its own prompt and output, and one target forward verifies them all. No
    second model; pays where outputs copy their input (edits, extraction, code)."""

    decoding_type: Literal["NGram"] = "NGram"
    max_draft_len: int = Field(default=4, ge=1, le=64, description="Most tokens proposed per step.")
    max_matching_ngram_size: int = Field(
        default=3, ge=1, le=32, description="Longest suffix of the sequence looked up in its earlier tokens.")
    max_concurrency: int | None = Field(
        default=None, ge=1, description="Speculate only while at most this many requests run (larger batches are "
                                        "bound by compute, where rejected drafts cost); null: always.")


class DraftTargetDecodingConfig(StrictModel):
    """Speculative decoding with a draft model (the LLM API's DraftTargetDecodingConfig): a small model sharing
    the target's tokenizer proposes max_draft_len tokens greedily, one target forward verifies them. The draft runs
    on the engine's first rank, unsharded, its KV cache laid out as the target's (the same blocks, so a sequence's
    block table serves both)."""

    decoding_type: Literal["DraftTarget"] = "DraftTarget"
    max_draft_len: int = Field(default=4, ge=1, le=64, description="Tokens the draft model proposes per step.")
    speculative_model: str = Field(description="The draft model: HF id, local directory or .gguf file, with the "
                                               "target's vocabulary.")
    max_concurrency: int | None = Field(
        default=None, ge=1, description="Speculate only while at most this many requests run; null: always.")


SpeculativeConfig = Annotated[NGramDecodingConfig | DraftTargetDecodingConfig, Field(discriminator="decoding_type")]


class LoraConfig(StrictModel):
    """Multi-LoRA serving: PEFT-format adapters (adapter_config.json + adapter_model.safetensors) applied per request
    on top of the base model. Adapters live in max_loras device slots at once (loaded at their first request, the
    least recently used one without running requests making room); the workers keep max_cpu_loras adapters read
    from disk."""

    lora_dir: list[str] = Field(
        default_factory=list, description="Adapter directories checked against the model when the engine starts; a "
                                          "LoRARequest may name any adapter directory.")
    max_loras: int = Field(default=4, description="Adapters resident on the device at once.")
    max_cpu_loras: int | None = Field(
        default=None, description="Adapters each worker keeps read from disk (least recently used go first); null: "
                                  "max_loras. At least max_loras.")
    max_lora_rank: int = Field(default=64, description="The largest adapter rank accepted; device slots are this "
                                                       "wide.")

    @field_validator("max_loras", "max_lora_rank")
    @classmethod
    def _at_least_one(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            raise ValueError(f"lora_config.{info.field_name} must be >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _cpu_cache_holds_the_slots(self) -> LoraConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora_config.max_cpu_loras must be >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras}")
        return self

    @property
    def cpu_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class LlmArgs(StrictModel):
    """Arguments of `LLM(...)`; see the LLM API reference for each field."""

    model: str = Field(default=DEFAULT_MODEL_ALIAS, description="HF id, local directory, .gguf file or alias.")
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    revision: str | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    backend: Literal["pytorch"] = "pytorch"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    moe_expert_parallel_size: int | None = Field(default=None, ge=1)
    executor: Literal["auto", "local", "ray"] = "auto"

    max_batch_size: int = Field(default=256, ge=1)
    max_num_tokens: int = Field(default=8192, ge=1)
    max_seq_len: int | None = Field(default=None, ge=1)
    max_input_len: int | None = Field(default=None, ge=1, description="Longest prompt accepted, in tokens "
                                                                    "(default: max_seq_len - 1).")
    enable_chunked_prefill: bool = True
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cuda_graph_config: CudaGraphConfig | None = Field(default_factory=CudaGraphConfig,
                                                      description="None disables CUDA graphs.")
    disable_overlap_scheduler: bool = Field(
        default=False, description="Schedule and queue each iteration only after the previous one's tokens reach "
                                   "the host, instead of while the device computes it.")
    disable_pipeline_overlap: bool = Field(
        default=False, description="Pipelines run each step through the stages in micro-batches instead of having "
                                   "the first stage work on step N+1 while the last finishes step N.")
    kernel_config: KernelConfig = Field(default_factory=KernelConfig)
    quant_config: QuantConfig = Field(default_factory=QuantConfig)
    sleep_config: SleepConfig = Field(default_factory=SleepConfig)
    speculative_config: SpeculativeConfig | None = Field(
        default=None, description="Speculative decoding (NGramDecodingConfig, DraftTargetDecodingConfig); null: "
                                  "none. Requests with "
                                  "penalties, min_tokens, guided decoding, beam search or several sequences, and "
                                  "those that set SamplingParams.use_speculative_decoding=False, decode without.")
    lora_config: LoraConfig | None = Field(default=None, description="Multi-LoRA serving; None: no adapters.")

    worker_extension_cls: Any = Field(
        default=None, description="A class (or 'module.Class') whose methods are mixed into every worker, "
                                  "for collective_rpc.")

    encode_only: bool | None = Field(
        default=None, description="The engine encodes prompts into embeddings (LLM.encode, /v1/embeddings) and "
                                  "generates nothing; null: true for encoder-only architectures (BertModel).")
    pooling_config: PoolingConfig | None = Field(
        default=None, description="How an encode_only engine pools hidden states into embeddings (default: the "
                                  "model's sentence-transformers config).")

    seed: int = Field(default=0, ge=0)
    iter_stats_max_iterations: int = Field(default=1000, ge=0)
    attention_backend: Literal["auto", "torch", "triton", "flashinfer"] = Field(
        default="auto", description="Attention kernels: 'auto' (Triton on a CUDA device, else torch), 'torch' "
                                    "(the reference), 'triton', or 'flashinfer' (needs the flashinfer package).")

    @field_validator("kv_cache_config", mode="before")
    @classmethod
    def _kv_cache_from_dict(cls, value: Any) -> Any:
        return KvCacheConfig(**value) if isinstance(value, dict) else value

    @field_validator("worker_extension_cls")
    @classmethod
    def _extension_is_a_class(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, type)):
            raise ValueError(f"worker_extension_cls must be a class or 'module.Class', got {type(value).__name__}")
        return value

    @model_validator(mode="after")
    def _check_lengths(self) -> LlmArgs:
        if (self.max_input_len is not None and self.max_seq_len is not None
                and self.max_input_len >= self.max_seq_len):
            raise ValueError(f"max_input_len must be < max_seq_len ({self.max_seq_len}), got {self.max_input_len}")
        return self

    @model_validator(mode="after")
    def _check_kv_cache_dtype(self) -> LlmArgs:
        if self.quant_config.kv_cache_quant_algo == "FP8" and self.kv_cache_config.dtype not in ("auto", "fp8"):
            raise ValueError(f"quant_config.kv_cache_quant_algo='FP8' asks for an FP8 KV cache, but "
                             f"kv_cache_config.dtype is {self.kv_cache_config.dtype!r}: leave it 'auto' or set 'fp8'")
        return self

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache stores: 'auto' (the model's dtype), a float dtype's name, or 'fp8'."""
        return "fp8" if self.quant_config.kv_cache_quant_algo == "FP8" else self.kv_cache_config.dtype

    @model_validator(mode="after")
    def _check_parallelism(self) -> LlmArgs:
        if self.moe_expert_parallel_size is not None and self.moe_expert_parallel_size > self.tensor_parallel_size:
            raise ValueError(
                f"moe_expert_parallel_size must be <= tensor_parallel_size ({self.tensor_parallel_size}), "
                f"got {self.moe_expert_parallel_size}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
