"""A worker: one per device. It loads its shard of the model, owns the KV cache, and on rank 0 hosts the
engine core. The in-process executor runs one directly; the Ray executor wraps it in an actor."""

from __future__ import annotations

import os
import time
import uuid

import torch

from raylm.engine.engine_core import EngineCore, EngineLimits
from raylm.engine.model_runner import ModelRunner
from raylm.engine.pooling_engine import PoolingEngine
from raylm.engine.pooling_runner import PoolingRunner
from raylm.engine.speculative import make_proposer
from raylm.engine_spec import EngineInfo, WorkerSpec
from raylm.lora_request import LoRARequest
from raylm.models.loader import load_hf_config, load_model
from raylm.models.parallel import SINGLE, ParallelContext

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without a max_tokens setting, a CPU engine gives its KV cache this many bytes.
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


class Worker:
    """One device's share of the engine. Start-up runs in three parts so that a multi-rank engine can agree
    on one KV capacity: load_model (returns this rank's capacity), init_cache, then on rank 0 build_engine."""

    def __init__(self, spec: WorkerSpec, ctx: ParallelContext = SINGLE):
        self.spec = spec
        self.ctx = ctx
        self.device = torch.device(spec.device)
        self.dtype = _DTYPES[spec.dtype]
        self.timings: dict[str, dict[str, float]] = {"py_executor": {}}
        self.engine: EngineCore | PoolingEngine | None = None
        self.runner: ModelRunner | PoolingRunner | None = None
        self.draft_runner: ModelRunner | None = None  # speculative decoding's draft model, on the first rank
        self.arch = None
        self._checkpoint_shapes: dict[str, tuple[int, ...]] | None = None  # read at the first weight update
        self._weight_group = None  # a trainer's weight-update group (actors/weight_group.py)
        self._memory = None  # device memory by tag (engine/device_memory.py), made with the KV cache
        self._fixed = None  # where weights, buffers and KV cache keep their addresses (device_memory.FixedAddresses)
        self._begin = time.perf_counter()
        if spec.cpu_threads:
            torch.set_num_threads(spec.cpu_threads)

    def report_device_id(self) -> str:
        """The GPU's UUID on CUDA; on the CPU a stable id of this host and process."""
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return f"cpu-{uuid.getnode():012x}-{os.getpid()}"

    def update_weights(self, weights: dict | None) -> int:
        """This rank's part of AsyncLLM.update_weights: `weights` maps device ids (report_device_id) to tensor
        handles (rl_api/weight_transfer.py); this rank takes its device's, checks them all, then copies them in.
        Returns how many of this rank's parameters changed; None (finalize) changes nothing here."""
        if weights is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return 0
        from raylm.rl_api.weight_transfer import weights_for_device

        index = self.device.index if self.device.type == "cuda" else None
        return self.load_named_weights(weights_for_device(weights, self.report_device_id(), index))

    def load_named_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """New weights under checkpoint names (any subset), checked whole before any is copied
        (models/weight_update.py)."""
        from raylm.models.weight_update import apply_update, check_update

        self._require_resident("model_weights", "update_weights")
        check_update(named, self._shapes(), self.dtype, self.arch.architecture)
        return apply_update(self.runner.model, named)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "nccl", timeout_s: float = 60.0) -> None:
        """Joins a trainer's weight-update group (actors/weight_group.py) as rank rank_offset + this rank."""
        from raylm.actors.weight_group import WeightUpdateGroup

        self.destroy_weight_update_group()
        rank = rank_offset + self.ctx.pp_rank * self.ctx.tp_size + self.ctx.tp_rank
        self._weight_group = WeightUpdateGroup(master_address, master_port, rank, world_size, backend, self.device,
                                               timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list) -> int:
        """Receives the tensors the trainer broadcasts in its weight-update group, in the order of `names`, after
        checking every name, shape and dtype (nothing is received for a bad list); copies each in as it comes."""
        from raylm.models.weight_update import apply_update, check_entries, parse_dtype

        if self._weight_group is None:
            raise RuntimeError("no weight-update group: call init_weight_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must be as long as each other, got {len(names)}, "
                             f"{len(dtypes)}, {len(shapes)}")
        self._require_resident("model_weights", "update_weights_from_distributed")
        entries = [(name, tuple(shape), parse_dtype(dtype)) for name, dtype, shape in zip(names, dtypes, shapes)]
        check_entries(entries, self._shapes(), self.dtype, self.arch.architecture)
        return sum(apply_update(self.runner.model, [(name, self._weight_group.receive(shape, dtype))])
                   for name, shape, dtype in entries)

    def destroy_weight_update_group(self) -> None:
        if self._weight_group is not None:
            self._weight_group.destroy()
            self._weight_group = None

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Keeps a LoRA adapter's matrices on this rank until remove_lora (LLM.add_lora calls it on every rank, as
        collective_rpc("add_lora", (lora_request,)) would); the engine loads them into a device slot when a request
        uses it."""
        self._lora_runtime("add_lora").add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets a LoRA adapter's matrices on this rank; whether it held any. The engine's side (its device slot,
        its cached prefixes) is LLM.remove_lora's."""
        return self._lora_runtime("remove_lora").remove(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters added on this rank."""
        return self._lora_runtime("list_loras").added()

    def _lora_runtime(self, what: str):
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError(f"{what} needs an engine started with lora_config")
        return lora

    def close(self) -> None:
        """Lets go of the model, the KV cache and the graphs and gives their device memory back (the local
        executor's shutdown: this process lives on, and may start another engine on the same device)."""
        if isinstance(self.runner, ModelRunner):
            self.runner.drop_graphs()
            self.runner.kv_caches = []
        self.engine = self.runner = self.draft_runner = self._memory = None
        self.destroy_weight_update_group()
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ device memory by tag

    def release_memory(self, tags: list[str]) -> None:
        """Frees this rank's device memory of `tags` (engine/device_memory.py)."""
        self._tagged_memory().release(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self._tagged_memory().resume(tags)

    def memory_status(self) -> dict:
        """Per tag: bytes held when resident and whether it is; and the device's free and total bytes."""
        from raylm.engine.device_memory import process_device_bytes

        status = {"tags": self._tagged_memory().status(), "keep_addresses": self._fixed is not None}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            status.update(device_free_bytes=free, device_total_bytes=total,
                          process_allocated_bytes=torch.cuda.memory_allocated(self.device),
                          process_reserved_bytes=torch.cuda.memory_reserved(self.device),
                          process_device_bytes=process_device_bytes(self.device))
        return status

    def _tagged_memory(self):
        from raylm.engine.device_memory import TaggedMemory

        if self._memory is None:
            self._memory = TaggedMemory(self.runner, self._capture_graphs, self.spec.args.sleep_config.model_weights,
                                        self._fixed)
        return self._memory

    def _capture_graphs(self) -> None:
        from raylm.engine.cuda_graphs import prefill_row_sizes

        sizes = self._graph_batch_sizes()
        if sizes:  # cuda_graph_config is set, on CUDA
            args = self.spec.args
            prefill_rows = min(args.cuda_graph_config.prefill_max_tokens, args.max_num_tokens)
            self.runner.capture_graphs(sizes, self.spec.max_seq_len, self.ctx.pp_size,
                                       verify_rows=args.speculative_config is not None,
                                       prefill_sizes=prefill_row_sizes(prefill_rows))

    def _require_resident(self, tag: str, what: str) -> None:
        if self._memory is not None and tag in self._memory.released:
            raise ValueError(f"{what} needs {tag} on the device: resume([{tag!r}]) first")

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's names and full shapes (models/weight_update.py), read at the first weight update."""
        from raylm.models.weight_update import checkpoint_shapes

        if self._checkpoint_shapes is None:
            hf_config = load_hf_config(self.spec.source, self.spec.args.trust_remote_code)
            self._checkpoint_shapes = checkpoint_shapes(hf_config)
        return self._checkpoint_shapes

    @property
    def kv_dtype(self) -> torch.dtype:
        kv_dtype = self.spec.args.kv_cache_dtype
        if kv_dtype == "auto" and self.spec.fp8 is not None and self.spec.fp8.kv_cache:
            kv_dtype = "fp8"  # the checkpoint was made for an FP8 KV cache (models/quantization.py)
        if kv_dtype == "fp8":
            return torch.float8_e4m3fn
        return self.dtype if kv_dtype == "auto" else _DTYPES[kv_dtype]

    def load_model(self) -> int:
        """Loads this rank's shard of the model; returns how many KV blocks this rank can hold (none for an
        encode_only engine, which has no KV cache)."""
        from raylm.engine.device_memory import fixed_addresses, move_into_region, region

        begin = time.perf_counter()
        args = self.spec.args
        hf_config = load_hf_config(self.spec.source, args.trust_remote_code)
        sleep = args.sleep_config
        self._fixed = fixed_addresses(sleep.keep_addresses, self.device)
        encode_only = self.spec.pooling is not None
        with region(self._fixed, "model_weights", keep_contents=sleep.model_weights == "host_copy"):
            loaded = load_model(self.spec.source, hf_config, self.dtype, self.device, self.spec.max_seq_len,
                                args.load_format, ctx=self.ctx, seed=args.seed, encode_only=encode_only,
                                fp8=self.spec.fp8)
        lora = None
        if args.lora_config is not None and not encode_only:  # adapter slots: buffers of the model's layers
            from raylm.models.lora import LoraRuntime

            lora = LoraRuntime(loaded.model, loaded.arch, args.lora_config, self.dtype, self.device)
        move_into_region(self._fixed, list(loaded.model.buffers()), "model", keep_contents=True)
        self.arch = loaded.arch
        self.timings["model_loader"] = loaded.timings
        if encode_only:
            self.runner = PoolingRunner(loaded.model, self.device, self.spec.pooling, args.kernel_config)
            self.timings["py_executor"]["model_engine_creation_seconds"] = time.perf_counter() - begin
            return 0
        self.runner = ModelRunner(loaded.model, loaded.arch, self.device, self.dtype,
                                  args.kv_cache_config.tokens_per_block, seed=args.seed,
                                  attention_backend=args.attention_backend, kernel_config=args.kernel_config,
                                  capture_logits=args.cuda_graph_config is not None
                                  and args.cuda_graph_config.capture_logits,
                                  fp8_kv_scales=args.kv_cache_config.fp8_scales)
        self.runner.lora = lora
        if self.spec.draft_source is not None and self.ctx.tp_rank == 0 and self.ctx.pp_rank == 0:
            self.draft_runner = self._load_draft()
        self.timings["py_executor"]["model_engine_creation_seconds"] = time.perf_counter() - begin
        return self._num_blocks(self.kv_dtype)

    def _load_draft(self) -> ModelRunner:
        """The draft model (DraftTargetDecodingConfig), whole on this device, in the target's dtype and kernels."""
        from raylm.engine.device_memory import region

        args, source = self.spec.args, self.spec.draft_source
        begin = time.perf_counter()
        with region(self._fixed, "model_weights", keep_contents=args.sleep_config.model_weights == "host_copy"):
            draft = load_model(source, load_hf_config(source, args.trust_remote_code), self.dtype, self.device,
                               self.spec.max_seq_len, args.load_format, seed=args.seed + 1)
        self.timings["model_loader"]["draft_weight_population_seconds"] = time.perf_counter() - begin
        return ModelRunner(draft.model, draft.arch, self.device, self.dtype, args.kv_cache_config.tokens_per_block,
                           seed=args.seed, attention_backend=args.attention_backend, kernel_config=args.kernel_config,
                           capture_logits=False, fp8_kv_scales=args.kv_cache_config.fp8_scales)

    def init_cache(self, num_blocks: int) -> EngineInfo:
        from raylm.engine.device_memory import region

        if self.spec.pooling is not None:  # encode_only: no KV cache, no decode steps to warm up or capture
            return self._engine_info(0)
        begin = time.perf_counter()
        with region(self._fixed, "kv_cache"):
            self.runner.allocate_kv_cache(num_blocks, self.kv_dtype)
            if self.draft_runner is not None:
                self.draft_runner.allocate_kv_cache(num_blocks, self.kv_dtype)
        seconds = time.perf_counter() - begin
        self.timings["py_executor"]["final_kv_cache_creation_seconds"] = seconds
        self.timings["py_executor"]["kv_cache_capacity_configuration_seconds"] = seconds
        self.runner.warm_up_decode(self.spec.max_seq_len)
        if self.draft_runner is not None:
            self.draft_runner.warm_up_decode(self.spec.max_seq_len)
        sizes = self._graph_batch_sizes()
        if sizes:
            begin = time.perf_counter()
            self._tagged_memory().capture()
            self.timings.setdefault("final_model_engine", {})["gen_cuda_graph_capture_seconds"] = (
                time.perf_counter() - begin)
        return self._engine_info(num_blocks)

    def _engine_info(self, num_blocks: int) -> EngineInfo:
        return EngineInfo(num_blocks, self.spec.args.kv_cache_config.tokens_per_block, self.spec.max_seq_len,
                          self.arch.vocab_size, self.spec.device, self.spec.dtype, self.timings,
                          pooling=self.spec.pooling)

    def build_engine(self, num_blocks: int, runner=None) -> EngineCore | PoolingEngine:
        """The engine core (rank 0 only), stepping `runner` (this worker's runner unless given); an encode_only
        engine's batches prompts into pooling forwards."""
        args = self.spec.args
        if self.spec.pooling is not None:
            self.engine = PoolingEngine(runner or self.runner, args.max_batch_size, args.max_num_tokens)
            self.timings["py_executor"]["total_py_executor_creation_seconds"] = time.perf_counter() - self._begin
            return self.engine
        kv_config = args.kv_cache_config
        self.engine = EngineCore(runner or self.runner, EngineLimits(
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            max_seq_len=self.spec.max_seq_len,
            block_size=kv_config.tokens_per_block,
            num_blocks=num_blocks,
            enable_block_reuse=kv_config.enable_block_reuse,
            enable_chunked_prefill=args.enable_chunked_prefill,
            event_buffer_max_size=kv_config.event_buffer_max_size,
            iter_stats_max_iterations=args.iter_stats_max_iterations,
            overlap_scheduling=not args.disable_overlap_scheduler,
            guarantee_no_evict=args.scheduler_config.capacity_scheduler_policy == "GUARANTEED_NO_EVICT",
            max_loras=args.lora_config.max_loras if args.lora_config is not None else 0,
            max_verify_rows=self._max_verify_rows(),
        ), grammar_compiler=None if args.skip_tokenizer_init else self._grammar_compiler,
            proposer=make_proposer(args.speculative_config, self.draft_runner, self.arch.vocab_size))
        self.timings["py_executor"]["total_py_executor_creation_seconds"] = time.perf_counter() - self._begin
        return self.engine

    def _max_verify_rows(self) -> int | None:
        """The largest decode graph's rows where speculative decoding's verify steps replay the graphs."""
        sizes = self._graph_batch_sizes()
        if self.spec.args.speculative_config is None or not sizes or not self.runner.graphs_fit(self.ctx.pp_size):
            return None
        return max(sizes)

    def _grammar_compiler(self):
        """Structured output's compiler for this model's tokenizer (made at the first guided request)."""
        from raylm.engine.structured_output import GrammarCompiler
        from raylm.tokenizer import load_tokenizer

        begin = time.perf_counter()
        compiler = GrammarCompiler(load_tokenizer(self.spec.args, self.spec.source), self.arch.vocab_size)
        self.timings["py_executor"]["guided_decoder_creation_seconds"] = time.perf_counter() - begin
        return compiler

    def start(self) -> EngineInfo:
        """Single-process start-up: the whole model on this device."""
        num_blocks = self.load_model()
        info = self.init_cache(num_blocks)
        self.build_engine(num_blocks)
        return info

    def _graph_batch_sizes(self) -> list[int]:
        """The decode graphs' batch sizes (none off CUDA or without cuda_graph_config)."""
        from raylm.engine.cuda_graphs import default_batch_sizes

        args = self.spec.args
        graph_config = args.cuda_graph_config
        if graph_config is None or self.device.type != "cuda":
            return []
        limit = min(graph_config.max_batch_size or args.max_batch_size, args.max_batch_size)
        return graph_config.batch_sizes or default_batch_sizes(limit)

    def _num_blocks(self, kv_dtype: torch.dtype) -> int:
        kv_config = self.spec.args.kv_cache_config
        block_size = kv_config.tokens_per_block
        per_block = self.runner.kv_bytes_per_block(kv_dtype)
        if self.draft_runner is not None:  # the draft's cache has as many blocks
            per_block += self.draft_runner.kv_bytes_per_block(kv_dtype)
        token_cap = -(-kv_config.max_tokens // block_size) if kv_config.max_tokens else None
        if self.device.type == "cuda":
            args = self.spec.args
            begin = time.perf_counter()
            activations = self.runner.profile_activation_memory(min(args.max_num_tokens, self.spec.max_seq_len))
            sizes = self._graph_batch_sizes()
            if sizes:  # held by the decode graphs for good, beside the KV cache
                activations += self.runner.graph_logits_bytes(max(sizes), self.ctx.pp_size)
            self.timings.setdefault("initial_model_engine", {})["general_warmup_seconds"] = (
                time.perf_counter() - begin)
            free, _ = torch.cuda.mem_get_info(self.device)
            usable = max(0, free - activations) * (kv_config.free_gpu_memory_fraction or 0.9)
            memory_cap = int(usable) // per_block - 1  # the null block
            num_blocks = min(memory_cap, token_cap) if token_cap is not None else memory_cap
        else:
            num_blocks = token_cap if token_cap is not None else DEFAULT_CPU_KV_BYTES // per_block - 1
        if num_blocks < 1:
            raise ValueError(f"the KV cache does not fit: one block needs {per_block} bytes")
        return num_blocks
