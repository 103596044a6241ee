"""The API RL trainers drive: AsyncLLM."""

from raylm.rl_api.async_llm import AsyncLLM, MemoryReleasedError

__all__ = ["AsyncLLM", "MemoryReleasedError"]
