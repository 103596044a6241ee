"""load_tokenizer: the one way raylm loads a model's tokenizer, for the driver (LLM) and the HTTP ingress."""

from __future__ import annotations

from typing import Any

from raylm.config import LlmArgs
from raylm.models.source import ModelSource


def load_tokenizer(args: LlmArgs, source: ModelSource) -> Any:
    """The HF tokenizer of args.tokenizer, else the model's at `source`; None when args.skip_tokenizer_init."""
    if args.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    path = args.tokenizer or str(source.config_dir)
    return AutoTokenizer.from_pretrained(path, revision=args.tokenizer_revision,
                                         trust_remote_code=args.trust_remote_code)
