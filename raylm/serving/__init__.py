"""The OpenAI-compatible HTTP layer: `build_app(engine, ServingConfig(...))` returns a FastAPI app;
`raylm.serving.ray_serve.build_openai_app(ServeArgs(...))` returns the same server as a Ray Serve application."""

from raylm.serving.app import build_app, engine_dead_reason
from raylm.serving.config import ServeArgs, ServingConfig

__all__ = ["ServeArgs", "ServingConfig", "build_app", "engine_dead_reason"]
