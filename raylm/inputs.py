"""Prompts as users give them: a string, a list of token ids, a TextPrompt or a TokensPrompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Any]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptInputs = str | list[int] | TextPrompt | TokensPrompt


def is_single_prompt(inputs: Any) -> bool:
    """A str, a dict, or a flat list of ints is one prompt; a list of those is a batch."""
    if isinstance(inputs, (str, dict)):
        return True
    if isinstance(inputs, Sequence) and inputs and all(isinstance(x, int) and not isinstance(x, bool)
                                                       for x in inputs):
        return True
    return False


def to_prompt_list(inputs: Any) -> list[PromptInputs]:
    if is_single_prompt(inputs):
        return [inputs]
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        if not inputs:
            raise ValueError("inputs must contain at least one prompt, got an empty list")
        return list(inputs)
    raise TypeError(f"inputs must be a str, a list of token ids, a TextPrompt or a TokensPrompt (or a list of "
                    f"those), got {type(inputs).__name__}")


def tokenize_prompt(prompt: PromptInputs, tokenizer: Any, add_special_tokens: bool,
                    truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
    """Returns (prompt text if known, prompt token ids), the ids cut to their last truncate_prompt_tokens when
    that is set."""
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            text, ids = prompt["prompt"], None
            if not isinstance(text, str):
                raise TypeError(f"TextPrompt.prompt must be a str, got {type(text).__name__}")
        else:
            raise ValueError("a prompt dict needs a 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt) key")
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        text, ids = None, list(prompt)
    else:
        raise TypeError(f"a prompt must be a str, a list of token ids, a TextPrompt or a TokensPrompt, "
                        f"got {type(prompt).__name__}")
    if ids is None:
        if not text:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids when skip_tokenizer_init=True")
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise TypeError(f"prompt token ids must be integers, got {token!r}")
    if not ids:
        raise ValueError("prompt must not be empty (it has no tokens)")
    if truncate_prompt_tokens is not None:
        ids = ids[-truncate_prompt_tokens:]
    return text, ids


def check_prompt_length(prompt_len: int, max_seq_len: int) -> None:
    """Raises ValueError unless a prompt of prompt_len tokens leaves room for a token within max_seq_len."""
    if prompt_len >= max_seq_len:
        raise ValueError(f"prompt has {prompt_len} tokens; max_seq_len is {max_seq_len}, so it must be shorter")


def apply_chat_template(tokenizer: Any, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders a conversation with the tokenizer's chat template (or the one given)."""
    if tokenizer is None:
        raise ValueError("chat messages need a tokenizer")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
