"""Logprob entries as the OpenAI formats show them: a token's text, and an entry's most likely tokens."""

from __future__ import annotations

from typing import Any

from raylm.outputs import Logprob


def token_text(tokenizer: Any, token: int, logprob: Logprob | None) -> str:
    """A token's text, as its logprob entry decoded it (or decoded now)."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token])


def top_ranked(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The entry's num_top most likely tokens, most likely first (the chosen token only if among them)."""
    ranked = [(token, logprob) for token, logprob in entry.items()
              if logprob.rank is not None and logprob.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank)
