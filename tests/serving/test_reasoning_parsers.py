"""<think> reasoning split from the answer, whole and streamed in pieces of every size (so that pieces end inside
`<think>` and `</think>`), for DeepSeek-R1's and Qwen3's forms."""

from __future__ import annotations

import pytest

from raylm.serving.reasoning_parsers import REASONING_PARSERS, ReasoningStream, prompt_opens_thinking

R1 = REASONING_PARSERS["deepseek_r1"]
QWEN3 = REASONING_PARSERS["qwen3"]

# Outputs in the shapes the models write them.
R1_WITHOUT_OPEN_TAG = "Okay, 2 + 2: two pairs make 4.\n</think>\n\nThe answer is **4**."
R1_WITH_OPEN_TAG = "<think>\nOkay, 2 + 2 is 4.\n</think>\n\nThe answer is **4**."
QWEN3_THINKING = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"


def split(fmt, text: str, size: int, prompt: str | None = None) -> tuple[str, str]:
    stream = ReasoningStream(fmt, prompt)
    pieces = [text[start:start + size] for start in range(0, len(text), size)] or [""]
    parts = [stream.feed(piece, final=index == len(pieces) - 1) for index, piece in enumerate(pieces)]
    return "".join(part[0] for part in parts), "".join(part[1] for part in parts)


def assert_every_split(fmt, text: str, expected: tuple[str, str], prompt: str | None = None) -> None:
    for size in range(1, len(text) + 1):
        assert split(fmt, text, size, prompt) == expected, f"pieces of {size} characters"


def test_r1_thinks_from_the_start_with_or_without_the_opening_tag():
    expected = ("Okay, 2 + 2: two pairs make 4.\n", "The answer is **4**.")
    assert_every_split(R1, R1_WITHOUT_OPEN_TAG, expected)
    assert_every_split(R1, R1_WITH_OPEN_TAG, ("\nOkay, 2 + 2 is 4.\n", "The answer is **4**."))


def test_r1_cut_short_while_thinking_is_all_reasoning():
    assert_every_split(R1, "Let me think about </thi", ("Let me think about </thi", ""))


def test_qwen3_thinking_and_answer():
    assert_every_split(QWEN3, QWEN3_THINKING,
                       ("\nThe user greets me. I should greet back.\n", "Hello! How can I help?"))


@pytest.mark.parametrize("text", ["Hello there.", "<thought> is not the tag", "  <", "2 < 3"])
def test_qwen3_without_think_is_all_answer(text):
    assert_every_split(QWEN3, text, ("", text))


def test_qwen3_thinks_when_the_prompt_left_think_open():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert prompt_opens_thinking(prompt)
    assert_every_split(QWEN3, "Greet back.\n</think>\n\nHi!", ("Greet back.\n", "Hi!"), prompt)
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False
    assert not prompt_opens_thinking(closed)
    assert_every_split(QWEN3, "Hi!", ("", "Hi!"), closed)


def test_an_empty_answer_after_thinking():
    assert_every_split(R1, "hmm</think>\n\n", ("hmm", ""))
