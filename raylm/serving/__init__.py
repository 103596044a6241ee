"""The OpenAI-compatible HTTP layer: `build_app(LocalEngine(llm), ServingConfig(...))` returns a FastAPI app over
an LLM in this process; `raylm.serving.ray_serve.build_openai_app(ServeArgs(...))` returns the same server as a Ray
Serve application."""

from raylm.serving.app import build_app
from raylm.serving.config import ServeArgs, ServingConfig
from raylm.serving.engine import LocalEngine, ServingEngine

__all__ = ["LocalEngine", "ServeArgs", "ServingConfig", "ServingEngine", "build_app"]
