"""The engine as the HTTP app sees it: ServingEngine, what build_app serves, and GenerationStream, one request's
chunks (engine_stream.py). LocalEngine is a ServingEngine over an LLM in this process; RemoteEngine
(remote_engine.py) is one over the Ray Serve engine deployment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from raylm.engine_spec import EngineInfo
from raylm.inputs import PromptInputs, TokensPrompt
from raylm.lora_request import LoRARequest
from raylm.outputs import EncoderOutput
from raylm.results import GenerationResult
from raylm.sampling_params import SamplingParams
from raylm.serving.engine_stream import OutputChunk, output_chunks

if TYPE_CHECKING:
    from raylm.llm import LLM
    from raylm.rl_api import AsyncLLM


class GenerationStream(Protocol):
    """One request running in the engine."""

    async def admitted(self) -> None:
        """Returns once the engine accepted the request; raises what the engine found wrong with it (ValueError
        or TypeError for bad input, EngineDeadError when it cannot serve)."""

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        """The request's chunks up to its last; raises RequestError when the engine fails the request. Leaving
        early (or being cancelled) aborts the request."""

    def abort(self) -> None:
        """Stops the request in the engine, which frees its KV blocks."""


class ServingEngine(Protocol):
    """What build_app needs of an engine."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def info(self) -> EngineInfo: ...

    @property
    def startup_metrics(self) -> dict: ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve requests, or None while it can."""

    def stream(self, inputs: PromptInputs, sampling_params: SamplingParams, priority: float,
               cache_salt: str | None, each_step: bool = True,
               lora_request: LoRARequest | None = None) -> GenerationStream:
        """Submits one prompt (with a LoRA adapter when lora_request names one). Errors in it are raised here or
        by the stream's admitted(). Without `each_step` the stream holds one chunk, the request's last: a
        response that is not streamed costs the engine's process no per-step work for it."""

    async def embed(self, prompts: list[TokensPrompt]) -> list[EncoderOutput]:
        """Encodes prompts (an encode_only engine), one output each in order; raises ValueError or TypeError for bad
        input, EngineDeadError when the engine cannot serve, RequestError when it fails a prompt. Cancelling the
        call aborts the prompts."""

    def get_kv_cache_capacity(self) -> dict:
        """The KV cache's capacity; {} for an encode_only engine, which has none."""

    def get_stats(self, timeout: float | None = 2) -> list[dict]:
        """The engine's iteration statistics since the last call; blocks up to timeout for the first."""

    # The RL control of rl_routes.py, AsyncLLM's: each raises ValueError or TypeError for bad input (and
    # pickle.UnpicklingError for a weight payload that holds more than tensor handles), NotImplementedError when
    # the engine has no RL control.

    async def pause_generation(self, mode: str) -> None: ...

    async def resume_generation(self) -> None: ...

    async def update_weights(self, weights: dict[str, str] | None) -> None: ...

    async def get_weight_version(self) -> int: ...

    async def get_device_ids(self) -> list[str]:
        """The device id of every engine rank, which update_weights keys its payloads by."""

    async def release_memory(self, tags: list[str]) -> None:
        """Frees the device memory of `tags` (engine/device_memory.py TAGS) on every rank: AsyncLLM.release."""

    async def resume_memory(self, tags: list[str]) -> None:
        """Brings the memory of `tags` back on every rank: AsyncLLM.resume."""

    async def get_memory_status(self) -> list[list[dict]]:
        """One list per engine replica (an engine in this process is one) of its ranks' memory status, in rank
        order, as AsyncLLM.get_memory_status returns it."""


async def encode_all(llm: LLM, prompts: list[TokensPrompt]) -> list[EncoderOutput]:
    """Submits every prompt to `llm`'s encode_only engine and awaits their outputs; a prompt it refuses, a failed
    one or cancelling aborts all of them."""
    results: list[GenerationResult] = []
    try:
        for prompt in prompts:
            results.append(llm.encode_async(prompt))
        return [await result for result in results]
    except BaseException:
        for result in results:
            result.abort()
        raise


class LocalGeneration:
    """A request running in an LLM in this process, as a GenerationStream."""

    def __init__(self, result: GenerationResult, params: SamplingParams):
        self._result = result
        self._params = params

    async def admitted(self) -> None:
        """Nothing to wait for: the LLM checked the request when it was submitted."""

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return output_chunks(self._result, self._params)

    def abort(self) -> None:
        self._result.abort()


class LocalEngine:
    """A ServingEngine over an LLM (or AsyncLLM) in this process: build_app(LocalEngine(llm), config). The RL
    control (rl_routes.py) needs an AsyncLLM."""

    def __init__(self, llm: LLM):
        self.llm = llm

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def info(self) -> EngineInfo:
        return self.llm.info

    @property
    def startup_metrics(self) -> dict:
        return self.llm.startup_metrics

    @property
    def dead_reason(self) -> str | None:
        return self.llm.dead_reason

    def stream(self, inputs: PromptInputs, sampling_params: SamplingParams, priority: float,
               cache_salt: str | None, each_step: bool = True,
               lora_request: LoRARequest | None = None) -> LocalGeneration:
        result = self.llm.generate_async(inputs, sampling_params, streaming=each_step, priority=priority,
                                         cache_salt=cache_salt, lora_request=lora_request)
        return LocalGeneration(result, sampling_params)

    async def embed(self, prompts: list[TokensPrompt]) -> list[EncoderOutput]:
        return await encode_all(self.llm, prompts)

    def get_kv_cache_capacity(self) -> dict:
        return {} if self.llm.encode_only else self.llm.get_kv_cache_capacity()

    def get_stats(self, timeout: float | None = 2) -> list[dict]:
        return self.llm.get_stats(timeout)

    # ------------------------------------------------------------------ RL control

    def _async_llm(self) -> AsyncLLM:
        from raylm.rl_api import AsyncLLM

        if not isinstance(self.llm, AsyncLLM):
            raise NotImplementedError(f"the RL endpoints need an AsyncLLM engine; this server runs an "
                                      f"{type(self.llm).__name__}")
        return self.llm

    async def pause_generation(self, mode: str) -> None:
        await self._async_llm().pause_generation(mode)

    async def resume_generation(self) -> None:
        await self._async_llm().resume_generation()

    async def update_weights(self, weights: dict[str, str] | None) -> None:
        await self._async_llm().update_weights(weights)

    async def get_weight_version(self) -> int:
        return self._async_llm().weight_version

    async def get_device_ids(self) -> list[str]:
        return await self._async_llm().collective_rpc("report_device_id")

    async def release_memory(self, tags: list[str]) -> None:
        await self._async_llm().release(tags)

    async def resume_memory(self, tags: list[str]) -> None:
        await self._async_llm().resume(tags)

    async def get_memory_status(self) -> list[list[dict]]:
        return [await self._async_llm().get_memory_status()]
