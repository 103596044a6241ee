"""A reasoning model's output split into its thinking and its answer, whole or as the text streams.

Both supported forms write the thinking as `<think>...</think>` before the answer:
- deepseek_r1: the output starts in the thinking, whether it writes `<think>` itself or the chat template put it
  at the end of the prompt (R1's newer templates do); an output without `</think>` is all thinking (cut short);
- qwen3: the output thinks only when it opens with `<think>`, or when the prompt ends inside an open `<think>`
  (Qwen3's thinking-only templates); otherwise (enable_thinking=False writes an empty, closed block into the
  prompt) it is all answer.
Whitespace between `</think>` and the answer is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_thinking: bool  # an output with no opening tag is thinking


REASONING_PARSERS = {fmt.name: fmt for fmt in (ReasoningFormat("deepseek_r1", True), ReasoningFormat("qwen3", False))}


def prompt_opens_thinking(prompt: str | None) -> bool:
    """Whether the prompt ends inside a `<think>` block, so that the output starts thinking."""
    return prompt is not None and prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class _State(Enum):
    START = 1  # not yet known whether the output opens with <think>
    THINKING = 2
    ANSWER_START = 3  # after </think>, before the answer's first non-space character
    ANSWER = 4


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of text could begin marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ReasoningStream:
    """One output's text, split into reasoning and answer as it arrives."""

    def __init__(self, fmt: ReasoningFormat, prompt: str | None = None):
        self._thinks_without_tag = fmt.starts_thinking or prompt_opens_thinking(prompt)
        self._text = ""
        self._pos = 0
        self._state = _State.START

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Takes the output's next text (final: its last); returns the reasoning and the answer text it completes."""
        self._text += text
        reasoning, answer = "", ""
        if self._state is _State.START:
            rest = self._text[self._pos:]
            stripped = rest.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._pos += len(rest) - len(stripped) + len(THINK_OPEN)
                self._state = _State.THINKING
            elif THINK_OPEN.startswith(stripped) and not final:
                return "", ""
            else:
                self._state = _State.THINKING if self._thinks_without_tag else _State.ANSWER
        if self._state is _State.THINKING:
            end = self._text.find(THINK_CLOSE, self._pos)
            if end < 0:
                keep = 0 if final else _held_back(self._text[self._pos:], THINK_CLOSE)
                reasoning = self._text[self._pos:len(self._text) - keep]
                self._pos = len(self._text) - keep
                return reasoning, ""
            reasoning = self._text[self._pos:end]
            self._pos, self._state = end + len(THINK_CLOSE), _State.ANSWER_START
        if self._state is _State.ANSWER_START:
            rest = self._text[self._pos:]
            if not rest.strip():
                self._pos = len(self._text)
                return reasoning, ""
            self._pos += len(rest) - len(rest.lstrip())
            self._state = _State.ANSWER
        answer = self._text[self._pos:]
        self._pos = len(self._text)
        return reasoning, answer
