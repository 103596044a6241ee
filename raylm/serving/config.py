"""ServingConfig: what the OpenAI-compatible HTTP layer needs besides the engine."""

from __future__ import annotations

import os

from pydantic import Field

from raylm.config import StrictModel


def _default_profile_dir() -> str:
    return os.environ.get("RAYLM_TORCH_PROFILER_DIR", "/tmp")


class ServingConfig(StrictModel):
    """Settings of one HTTP front end over one engine."""

    served_model_name: str = Field(min_length=1, description="The model name clients send and /v1/models lists.")
    api_key: str | None = Field(
        default=None, min_length=1,
        description="When set, every route but /health needs the header 'Authorization: Bearer <api_key>'.",
    )
    max_queue: int = Field(
        default=1024, ge=1,
        description="Generation requests in flight (running or waiting) the server holds; more are answered 429.",
    )
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template that replaces the tokenizer's for chat and responses.",
    )
    profile_dir: str = Field(
        default_factory=_default_profile_dir,
        description="Where /start_profile writes chrome traces when the request names no output_dir.",
    )
