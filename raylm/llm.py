"""LLM: the offline API. Prepares inputs, submits them to the engine, and returns RequestOutputs."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

from raylm.actors.executor import Executor, LocalExecutor
from raylm.config import LlmArgs
from raylm.engine_client import EngineClient
from raylm.engine_spec import EngineInfo, WorkerSpec, resolve_device, resolve_dtype
from raylm.inputs import PromptInputs, check_prompt_length, is_single_prompt, to_prompt_list, tokenize_prompt
from raylm.lora_registry import LoraRegistry, check_lora_model, require_lora_request
from raylm.lora_request import LoRARequest
from raylm.models.arch import config_dtype
from raylm.models.loader import load_hf_config
from raylm.models.quantization import resolve_fp8_weights
from raylm.models.registry import resolve_architecture
from raylm.models.source import ModelSource, resolve_model
from raylm.outputs import EncoderOutput, RequestOutput
from raylm.pooling import PoolingSpec, resolve_pooling, sentence_transformers_max_length
from raylm.results import GenerationResult
from raylm.sampling_params import SamplingParams
from raylm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Every LLM whose engine runs, so that those a driver leaves open are shut down when the interpreter exits.
_OPEN_LLMS: weakref.WeakSet[LLM] = weakref.WeakSet()


def _shutdown_open_llms() -> None:
    """Shuts down every LLM still open; an atexit hook."""
    for llm in list(_OPEN_LLMS):
        try:
            llm.shutdown()
        except Exception:
            logger.exception("shutting down an LLM left open at exit failed")


def _track_open(llm: LLM) -> None:
    _OPEN_LLMS.add(llm)
    # Registered again after each engine starts, so that it runs first at exit (atexit runs hooks last in,
    # first out): before Ray's own hook that ray.init registered, while the workers can still be stopped.
    atexit.unregister(_shutdown_open_llms)
    atexit.register(_shutdown_open_llms)


def _eos_token_ids(source: ModelSource, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's, else the model config's, plus the tokenizer's."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        generation = GenerationConfig.from_pretrained(str(source.config_dir))
        eos = generation.eos_token_id
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if not ids:
        eos = getattr(hf_config, "eos_token_id", None)
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


class LLM:
    """Loads a model and generates from it.

    `LLM()` with no model runs the embedded default, SmolLM2-135M-Instruct. Keyword arguments are those
    of `LlmArgs` (max_batch_size, max_num_tokens, max_seq_len, kv_cache_config, dtype, ...). An encode_only
    engine (encoder-only models such as BertModel, or encode_only=True) encodes prompts into embeddings instead.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs: Any):
        self._placement = {key: kwargs.pop(key, None) for key in
                           ("placement_groups", "placement_bundle_indices", "per_worker_gpu_share")}
        begin = time.perf_counter()
        if model is not None:
            kwargs["model"] = model
        self.args = LlmArgs(tokenizer=tokenizer, **kwargs)
        self._request_ids = itertools.count()
        self._client: EngineClient | None = None
        source = resolve_model(self.args.model, self.args.revision)
        hf_config = load_hf_config(source, self.args.trust_remote_code)
        self._tokenizer = load_tokenizer(self.args, source)
        self._eos_ids = _eos_token_ids(source, hf_config, self._tokenizer)
        pooling = self._pooling(source, hf_config)
        lora_arch = (check_lora_model(self.args.lora_config, hf_config, pooling is not None)
                     if self.args.lora_config is not None else None)
        prepared = time.perf_counter()
        device = resolve_device(self.args.device)
        dtype = resolve_dtype(self.args.dtype, device, config_dtype(hf_config))
        spec = WorkerSpec(self.args, source, device, dtype, self._max_seq_len(source, hf_config, pooling),
                          pooling=pooling, fp8=resolve_fp8_weights(self.args.quant_config, hf_config),
                          draft_source=self._draft_source(hf_config, pooling))
        self._executor = self._create_executor(spec, device)
        self._loras = (LoraRegistry(self.args.lora_config, lora_arch, self._executor)
                       if lora_arch is not None else None)
        self.info: EngineInfo = self._executor.info
        self._client = EngineClient(self._executor, self._tokenizer, self.args.iter_stats_max_iterations,
                                    self.args.kv_cache_config.event_buffer_max_size)
        _track_open(self)
        self._startup_metrics = dict(self.info.startup_metrics)
        self._startup_metrics.setdefault("py_executor", {})
        self._startup_metrics["py_executor"]["config_and_checkpoint_loader_initialization_seconds"] = (
            prepared - begin)
        self._startup_metrics["total_llm_creation_seconds"] = time.perf_counter() - begin

    def _draft_source(self, hf_config: Any, pooling: PoolingSpec | None) -> ModelSource | None:
        """The draft model of a DraftTargetDecodingConfig, checked against the target: its tokens must be the
        target's (a vocabulary no larger), and the engine must generate."""
        config = self.args.speculative_config
        if config is None or config.decoding_type != "DraftTarget":
            return None
        if pooling is not None:
            raise ValueError("speculative_config needs an engine that generates, not an encode_only one")
        source = resolve_model(config.speculative_model)
        draft_vocab = load_hf_config(source, self.args.trust_remote_code).vocab_size
        if draft_vocab > hf_config.vocab_size:
            raise ValueError(f"speculative_config.speculative_model {config.speculative_model!r} has a vocabulary of "
                             f"{draft_vocab} tokens, more than the target's {hf_config.vocab_size}: the draft must "
                             "share the target's tokenizer")
        return source

    def _pooling(self, source: ModelSource, hf_config: Any) -> PoolingSpec | None:
        """The engine's pooling when it is encode_only (encode_only=True, or unset for an encoder-only model),
        else None."""
        args = self.args
        entry, _ = resolve_architecture(hf_config)
        architecture = entry.model_class.__name__
        if entry.encoder_only and args.encode_only is False:
            raise ValueError(f"encode_only must be true or unset for {architecture}, got False: an encoder-only "
                             "model cannot generate")
        if not (entry.encoder_only or args.encode_only):
            if args.pooling_config is not None:
                raise ValueError("pooling_config needs an encode_only engine: set encode_only=True")
            return None
        if args.world_size > 1:
            raise ValueError(f"encode_only engines run on one device: tensor_parallel_size and pipeline_parallel_size "
                             f"must be 1, got {args.tensor_parallel_size} and {args.pipeline_parallel_size}")
        return resolve_pooling(source.config_dir, hf_config, args.pooling_config, entry.encoder_only)

    def _max_seq_len(self, source: ModelSource, hf_config: Any, pooling: PoolingSpec | None) -> int:
        """max_seq_len, else the model's positions (for encode_only, capped by the longest input its
        sentence-transformers config was set up for)."""
        if self.args.max_seq_len is not None:
            return self.args.max_seq_len
        positions = int(getattr(hf_config, "max_position_embeddings", None) or 4096)
        configured = sentence_transformers_max_length(source.config_dir) if pooling is not None else None
        return min(positions, configured) if configured else positions

    def _uses_ray(self) -> bool:
        from raylm.actors.ray_executor import ray_cluster_is_up

        if self.args.executor != "auto":
            return self.args.executor == "ray"
        return self.args.world_size > 1 or bool(self._placement["placement_groups"]) or ray_cluster_is_up()

    def _create_executor(self, spec: WorkerSpec, device: str) -> Executor:
        args = self.args
        if not self._uses_ray():
            if args.world_size > 1:
                raise ValueError("tensor_parallel_size x pipeline_parallel_size > 1 needs executor='ray'")
            if any(value is not None for value in self._placement.values()):
                raise ValueError("placement_groups, placement_bundle_indices and per_worker_gpu_share need "
                                 "executor='ray'")
            return LocalExecutor(spec)
        from raylm.actors.ray_executor import RayExecutor
        from raylm.actors.transport import RankLayout

        if device == "cpu":
            spec.cpu_threads = max(1, (os.cpu_count() or 1) // args.world_size)
        layout = RankLayout(args.tensor_parallel_size, args.pipeline_parallel_size,
                            args.moe_expert_parallel_size or 1)
        return RayExecutor(spec, layout, worker_extension_cls=args.worker_extension_cls, **self._placement)

    # ------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def startup_metrics(self) -> dict:
        return self._startup_metrics

    @property
    def encode_only(self) -> bool:
        """Whether this engine encodes prompts into embeddings (encode) rather than generating."""
        return self.info.pooling is not None

    def get_kv_cache_capacity(self) -> dict:
        if self.encode_only:
            raise RuntimeError("an encode_only engine has no KV cache")
        return {
            "maxNumBlocks": self.info.num_blocks,
            "tokensPerBlock": self.info.block_size,
            "maxNumTokens": self.info.num_blocks * self.info.block_size,
        }

    # ------------------------------------------------------------------ requests

    def _prepare_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and (not params.detokenize or self._tokenizer is None):
            raise ValueError("stop strings need detokenize=True and a tokenizer")
        if params.guided_decoding is not None:
            from raylm.engine.structured_output import check_guided

            if self._tokenizer is None:
                raise ValueError("guided_decoding needs the model's tokenizer (skip_tokenizer_init is set)")
            check_guided(params.guided_decoding)
        return dataclasses.replace(params, _eos_token_ids=self._eos_ids)

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        max_input_len = self.args.max_input_len
        if max_input_len is not None and prompt_len > max_input_len:
            raise ValueError(f"prompt has {prompt_len} tokens, more than max_input_len ({max_input_len})")
        max_seq_len = self.info.max_seq_len
        check_prompt_length(prompt_len, max_seq_len)
        if prompt_len + params.max_tokens > max_seq_len:
            raise ValueError(f"max_tokens must be <= {max_seq_len - prompt_len} for this prompt (max_seq_len "
                             f"{max_seq_len} minus the prompt's {prompt_len} tokens), got {params.max_tokens}")
        if not self.args.enable_chunked_prefill and prompt_len > self.args.max_num_tokens:
            raise ValueError(f"prompt has {prompt_len} tokens, more than max_num_tokens ({self.args.max_num_tokens});"
                             " enable chunked prefill or raise max_num_tokens")
        block = self.info.block_size
        per_sequence = -(-(prompt_len + params.max_tokens) // block)
        needed = per_sequence + (params.num_sequences - 1) * (-(-params.max_tokens // block) + 1)
        if needed > self.info.num_blocks:
            raise ValueError(f"request needs up to {needed} KV cache blocks but the cache holds "
                             f"{self.info.num_blocks}; raise kv_cache_config.max_tokens or lower max_tokens")

    def _check_lora_request(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The adapter a request runs with, as it goes to the engine (LoraRegistry.resolve)."""
        if lora_request is None:
            return None
        return self._lora_registry("lora_request").resolve(require_lora_request(lora_request))

    def _lora_registry(self, what: str) -> LoraRegistry:
        if self._loras is None:
            raise ValueError(f"{what} needs an engine started with lora_config")
        return self._loras

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads a LoRA adapter (its path, or in memory: peft_config and lora_tensors) on every worker ahead of its
        requests and keeps it there until remove_lora; requests may then name it by name and id alone
        (LoRARequest(name, id)). False when the id already holds this adapter. An RL loop replaces its adapter with
        remove_lora(id) then add_lora under the same id: no request runs with a mix of the two, and KV cached with
        the old one is never reused."""
        return self._lora_registry("add_lora").add(require_lora_request(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Frees a LoRA adapter's id, device slot and worker copies; False when no adapter holds the id. Refused
        (ValueError) while unfinished requests use it."""
        registry = self._lora_registry("remove_lora")
        if self._client is None:
            raise RuntimeError("the LLM is shut down")
        return registry.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine knows, by id (those added, and those requests brought), without their
        tensors."""
        return self._loras.adapters() if self._loras is not None else []

    def _submit(self, prompt: PromptInputs, params: SamplingParams, priority: float, streaming: bool,
                cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> GenerationResult:
        if not 0.0 <= priority <= 1.0:
            raise ValueError(f"priority must be in [0, 1], got {priority}")
        if self._client is None:
            raise RuntimeError("the LLM is shut down")
        if self.encode_only:
            raise ValueError(f"model {self.args.model!r} runs encode_only: it encodes prompts into embeddings "
                             "(encode) and cannot generate")
        text, token_ids = tokenize_prompt(prompt, self._tokenizer, params.add_special_tokens,
                                          params.truncate_prompt_tokens)
        self._check_token_ids(token_ids)
        self._check_fits(len(token_ids), params)
        lora_request = self._check_lora_request(lora_request)
        request_id = str(next(self._request_ids))
        return self._client.add(request_id, text, token_ids, params, priority, cache_salt, streaming, lora_request)

    def _check_token_ids(self, token_ids: list[int]) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")

    def generate(
        self,
        inputs: PromptInputs | Sequence[PromptInputs],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: float | list[float] = 0.5,
        cache_salt: str | Sequence[str] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generates for one prompt or a batch; returns one RequestOutput per prompt, in order. lora_request: the
        adapter of every prompt, or a list with one per prompt (None: the base model)."""
        single = is_single_prompt(inputs)
        prompts = to_prompt_list(inputs)
        params_list = self._per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = self._per_prompt(priority, len(prompts), "priority")
        salts = self._per_prompt(cache_salt, len(prompts), "cache_salt")
        adapters = self._per_prompt(lora_request, len(prompts), "lora_request")
        prepared = {id(p): self._prepare_params(p) for p in params_list}
        results = []
        try:
            for prompt, params, prio, salt, adapter in zip(prompts, params_list, priorities, salts, adapters):
                results.append(self._submit(prompt, prepared[id(params)], prio, False, salt, adapter))
        except Exception:
            for result in results:
                result.abort()
            raise
        outputs = self._collect(results, use_tqdm)
        return outputs[0] if single else outputs

    @staticmethod
    def _per_prompt(value: Any, count: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
            return list(value)
        return [value] * count

    def _collect(self, results: list[GenerationResult], use_tqdm: bool) -> list[RequestOutput]:
        progress = None
        if use_tqdm and len(results) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(results), desc="Processed prompts", dynamic_ncols=True)
        outputs = []
        try:
            for result in results:
                outputs.append(result.result())
                if progress is not None:
                    progress.update(1)
        except BaseException:
            for result in results:
                result.abort()
            raise
        finally:
            if progress is not None:
                progress.close()
        return outputs

    def generate_async(
        self,
        inputs: PromptInputs,
        sampling_params: SamplingParams | None = None,
        streaming: bool = False,
        priority: float = 0.5,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> GenerationResult:
        """Submits one prompt; await the result for the final output or `async for` over it to stream.
        lora_request: the adapter it generates with (None: the base model)."""
        if not is_single_prompt(inputs):
            raise TypeError("generate_async takes a single prompt; call it once per prompt")
        return self._submit(inputs, self._prepare_params(sampling_params), priority, streaming, cache_salt,
                            lora_request)

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        inputs: PromptInputs | Sequence[PromptInputs],
        add_special_tokens: bool = True,
        return_raw_logits: bool = False,
        use_tqdm: bool = True,
    ) -> EncoderOutput | list[EncoderOutput] | Any:
        """Encodes one prompt or a batch into embeddings, pooled as the model's sentence-transformers config (or
        pooling_config) says. Returns one EncoderOutput for a single prompt, a list for a batch (in order), or with
        return_raw_logits every embedding in one CPU tensor [prompts, hidden_size]. Needs an encode_only engine
        (RuntimeError otherwise); a prompt longer than max_seq_len or max_num_tokens is a ValueError."""
        single = is_single_prompt(inputs)
        outputs = self._collect(self._submit_encode(to_prompt_list(inputs), add_special_tokens), use_tqdm)
        if return_raw_logits:
            import torch

            return torch.stack([output.embedding for output in outputs])
        return outputs[0] if single else outputs

    def encode_async(self, inputs: PromptInputs, add_special_tokens: bool = True) -> GenerationResult:
        """Submits one prompt to encode; await the result (or call its result()) for its EncoderOutput."""
        if not is_single_prompt(inputs):
            raise TypeError("encode_async takes a single prompt; call it once per prompt")
        return self._submit_encode([inputs], add_special_tokens)[0]

    def _submit_encode(self, prompts: list[PromptInputs], add_special_tokens: bool) -> list[GenerationResult]:
        if self._client is None:
            raise RuntimeError("the LLM is shut down")
        if not self.encode_only:
            raise RuntimeError(f"encode needs an encode_only engine, and model {self.args.model!r} runs one that "
                               "generates: start it with LLM(model, encode_only=True)")
        tokenized = self._tokenize_all(prompts, add_special_tokens)
        for _, token_ids in tokenized:
            self._check_encodable(token_ids)
        # Shortest first: the engine batches in arrival order, so its batches then hold prompts of similar lengths,
        # which attention pads to the longest of each.
        order = sorted(range(len(tokenized)), key=lambda index: len(tokenized[index][1]))
        submitted = self._client.add_encode([(str(next(self._request_ids)), *tokenized[index]) for index in order])
        results: list[GenerationResult] = [None] * len(order)
        for index, result in zip(order, submitted):
            results[index] = result
        return results

    def _tokenize_all(self, prompts: list[PromptInputs],
                      add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt; the texts go through the tokenizer in one call."""
        texts = [prompt for prompt in prompts if isinstance(prompt, str) and prompt]
        encoded = iter(())
        if texts and self._tokenizer is not None:
            encoded = iter(self._tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])
        return [(prompt, next(encoded)) if isinstance(prompt, str) and prompt and self._tokenizer is not None
                else tokenize_prompt(prompt, self._tokenizer, add_special_tokens) for prompt in prompts]

    def _check_encodable(self, token_ids: list[int]) -> None:
        """A prompt is encoded whole in one forward: it must fit max_seq_len (the model's positions) and the step's
        max_num_tokens."""
        self._check_token_ids(token_ids)
        length, max_seq_len = len(token_ids), self.info.max_seq_len
        max_input_len = self.args.max_input_len
        if max_input_len is not None and length > max_input_len:
            raise ValueError(f"prompt has {length} tokens, more than max_input_len ({max_input_len})")
        if length > max_seq_len:
            raise ValueError(f"prompt has {length} tokens, more than max_seq_len ({max_seq_len}), the longest input "
                             f"this encoder takes")
        if length > self.args.max_num_tokens:
            raise ValueError(f"prompt has {length} tokens, more than max_num_tokens ({self.args.max_num_tokens}): an "
                             "encoded prompt runs whole in one step; raise max_num_tokens")

    # ------------------------------------------------------------------ stats and events

    def get_stats(self, timeout: float | None = 2) -> list[dict]:
        """Iteration statistics gathered since the last call (waits up to timeout for the first)."""
        return self._client.take_stats(timeout) if self._client else []

    async def get_stats_async(self, timeout: float | None = 2) -> AsyncIterator[dict]:
        stats = await asyncio.to_thread(self.get_stats, timeout)
        for entry in stats:
            yield entry

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict]:
        if not self.args.kv_cache_config.event_buffer_max_size:
            return []
        return self._client.take_kv_events(timeout) if self._client else []

    async def get_kv_cache_events_async(self, timeout: float | None = 2) -> AsyncIterator[dict]:
        events = await asyncio.to_thread(self.get_kv_cache_events, timeout)
        for event in events:
            yield event

    # ------------------------------------------------------------------ workers and health

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, target_ranks: int | list[int] | None = None) -> list:
        """Calls a worker method (or one of worker_extension_cls) on the target ranks; one result per rank,
        or only unique_reply_rank's."""
        if self._client is None:
            raise RuntimeError("the LLM is shut down")
        if isinstance(target_ranks, int):
            target_ranks = [target_ranks]
        results = self._executor.collective_rpc(method, tuple(args), kwargs, target_ranks)
        if unique_reply_rank is None:
            return results
        ranks = list(range(self.args.world_size)) if target_ranks is None else target_ranks
        if unique_reply_rank not in ranks:
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is not among the target ranks {ranks}")
        return [results[ranks.index(unique_reply_rank)]]

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve requests, or None while it can."""
        if self._client is None:
            return "the engine is shut down"
        if self._client.dead_reason is not None:
            return self._client.dead_reason
        if self._executor.is_healthy():
            return None
        # Seen here before the output channel noticed: from now on submissions fail at once, as they will then.
        self._client.mark_dead("an engine worker died")
        return self._client.dead_reason

    def check_health(self) -> None:
        """Raises RuntimeError when the engine cannot serve requests."""
        reason = self.dead_reason
        if reason is not None:
            raise RuntimeError(f"the engine is not running: {reason}")

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Stops the engine and releases its memory; outstanding requests fail."""
        client, self._client = self._client, None
        _OPEN_LLMS.discard(self)
        if client is not None:
            client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
