"""raylm: a Ray-native LLM inference engine."""

from raylm.config import (
    DraftTargetDecodingConfig,
    KvCacheConfig,
    LlmArgs,
    LoraConfig,
    NGramDecodingConfig,
    PoolingConfig,
    QuantConfig,
    SchedulerConfig,
)
from raylm.inputs import TextPrompt, TokensPrompt
from raylm.llm import LLM
from raylm.lora_request import LoRARequest
from raylm.outputs import CompletionOutput, EncoderOutput, Logprob, RequestOutput
from raylm.results import GenerationResult, RequestError
from raylm.rl_api import AsyncLLM
from raylm.sampling_params import GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "DraftTargetDecodingConfig",
    "EncoderOutput",
    "GenerationResult",
    "KvCacheConfig",
    "NGramDecodingConfig",
    "LlmArgs",
    "Logprob",
    "LoRARequest",
    "LoraConfig",
    "PoolingConfig",
    "QuantConfig",
    "RequestError",
    "RequestOutput",
    "GuidedDecodingParams",
    "SamplingParams",
    "SchedulerConfig",
    "TextPrompt",
    "TokensPrompt",
]
