"""The OpenAI-compatible HTTP layer: `build_app(engine, ServingConfig(...))` returns a FastAPI app."""

from raylm.serving.app import build_app, engine_dead_reason
from raylm.serving.config import ServingConfig

__all__ = ["ServingConfig", "build_app", "engine_dead_reason"]
