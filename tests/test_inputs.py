"""raylm.inputs: prompts to token ids (truncated when asked) and the check that one fits max_seq_len."""

from __future__ import annotations

import pytest

from raylm.inputs import check_prompt_length, tokenize_prompt


class CountingTokenizer:
    """Encodes each character as its code point."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(char) for char in text]


def test_a_prompt_is_tokenized_then_cut_to_its_last_truncate_prompt_tokens():
    assert tokenize_prompt("abc", CountingTokenizer(), True) == ("abc", [1, 97, 98, 99])
    assert tokenize_prompt("abc", CountingTokenizer(), True, truncate_prompt_tokens=2) == ("abc", [98, 99])
    assert tokenize_prompt({"prompt_token_ids": [5, 6, 7], "prompt": "x"}, None, True, 1) == ("x", [7])
    assert tokenize_prompt([5, 6, 7], None, False, 10) == (None, [5, 6, 7])


def test_a_prompt_must_leave_room_for_a_token_within_max_seq_len():
    check_prompt_length(1023, 1024)
    with pytest.raises(ValueError, match="prompt has 1024 tokens; max_seq_len is 1024, so it must be shorter"):
        check_prompt_length(1024, 1024)
