"""Structured output: a request's GuidedDecodingParams compiled with xgrammar into a token mask per step.

- grammar_of / check_guided: the grammar of a request, parsed without a tokenizer (the driver and the HTTP server
  check a request with it, so a malformed schema is a clear error before it reaches the engine);
- GrammarCompiler: the engine's compiler for its tokenizer; compiles on a thread of its own, never the engine's,
  and keeps each grammar by its text, so requests with the same schema compile once;
- Guide: one sequence's matcher, advanced by each token the sequence accepts; it masks the sequence's next draw
  until the grammar is complete (then only the stop tokens are allowed) and can wait for a marker first (a
  reasoning model's `</think>`: the constraint applies to the answer only).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from raylm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _message(exc: Exception) -> str:
    """xgrammar's error without its source location."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def grammar_of(guided: GuidedDecodingParams):
    """The xgrammar Grammar of `guided`; ValueError naming the field and what is wrong with it."""
    import xgrammar as xgr

    kind = guided.kind
    try:
        if kind == "json":
            schema = guided.json if isinstance(guided.json, str) else json.dumps(guided.json)
            return xgr.Grammar.from_json_schema(schema)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(guided.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(guided.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(guided.grammar)
        if kind == "lark":
            return xgr.Grammar.from_lark(guided.lark)
        tag = guided.structural_tag
        return xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"guided_decoding.{kind} is not valid: {_message(exc)}") from None


_CHECKED: OrderedDict[tuple[str, str], None] = OrderedDict()  # the latest grammars that parsed, by key


def check_guided(guided: GuidedDecodingParams) -> None:
    """Raises ValueError when `guided` does not parse (a malformed JSON schema, regex or grammar)."""
    key = guided.key()
    if key in _CHECKED:
        _CHECKED.move_to_end(key)
        return
    grammar_of(guided)
    _CHECKED[key] = None
    if len(_CHECKED) > 1024:
        _CHECKED.popitem(last=False)


def tokenizer_vocab_size(tokenizer) -> int:
    """How many ids the tokenizer can produce: its vocabulary and added tokens, up to the largest id."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer on a thread of its own, keeping the latest `cache_size`
    by their text: a schema that many requests share compiles once."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        import xgrammar as xgr

        self.tokenizer = tokenizer
        # The grammar sees the tokenizer's own ids; the model's padding rows past them (a 49K tokenizer on a 128K
        # embedding costs xgrammar 20x per mask and per token) are masked by one slice (mask_guided_rows).
        self.vocab_size = min(vocab_size, tokenizer_vocab_size(tokenizer))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-grammar")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.cache_size = cache_size

    def compile(self, guided: GuidedDecodingParams) -> Future:
        """A future of the compiled grammar (its exception a ValueError for a grammar that does not compile)."""
        key = guided.key()
        future = self._compiled.get(key)
        if future is None:
            future = self._compiled[key] = self._pool.submit(self._compile, guided)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return future

    def _compile(self, guided: GuidedDecodingParams):
        return self._compiler.compile_grammar(grammar_of(guided))

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Guide:
    """One sequence's place in its grammar. `stop_token_ids`: the tokens that end the sequence, which the grammar
    allows once complete; `begin_after`: token ids the output must contain before the constraint starts."""

    def __init__(self, compiled, stop_token_ids: list[int], begin_after: list[int] | None = None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.vocab_size = compiled.tokenizer_info.vocab_size  # the ids its mask covers; no later id is allowed
        self.begin_after = begin_after or None
        self._recent: list[int] = []  # the last tokens, to find begin_after in
        self.broken = False  # a token the mask did not allow was accepted: the guide stands aside

    @property
    def active(self) -> bool:
        """Whether the next draw is masked."""
        return self.begin_after is None and not self.broken and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if self.begin_after is not None:
            self._recent = (self._recent + [token_id])[-len(self.begin_after):]
            if self._recent == self.begin_after:
                self.begin_after = None
            return
        if not self.active:
            return
        if not self.matcher.accept_token(token_id):
            logger.warning("structured output: token %d is outside the grammar; the sequence goes on unconstrained",
                           token_id)
            self.broken = True

    def fill_masks(self, bitmask: torch.Tensor, first_row: int, drafts: tuple[int, ...] = ()) -> list[int]:
        """Fills bitmask row first_row + j with what the guide allows after the sequence's tokens and drafts[:j],
        for j = 0..len(drafts) (a speculating sequence's verify rows), and returns the rows it filled. The rows
        past a draft the grammar refuses are left unmasked: that draft's own row is masked, so its draw differs
        from it and no later draw is kept. The guide ends where it began (the drafts are rolled back)."""
        rows: list[int] = []
        begin_after, recent, accepted = self.begin_after, self._recent, 0
        for j in range(len(drafts) + 1):
            active = begin_after is None and not self.broken and not self.matcher.is_terminated()
            if active:
                self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
                rows.append(first_row + j)
            if j == len(drafts):
                break
            if begin_after is not None:  # not constrained yet: the drafts may complete begin_after
                recent = (recent + [drafts[j]])[-len(begin_after):]
                if recent == begin_after:
                    begin_after = None
            elif active:
                if not self.matcher.accept_token(drafts[j]):
                    break
                accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return rows

    def fork(self) -> Guide:
        twin = Guide.__new__(Guide)
        twin.matcher = self.matcher.fork()
        twin.vocab_size = self.vocab_size
        twin.begin_after = self.begin_after
        twin._recent = list(self._recent)
        twin.broken = self.broken
        return twin


def mask_guided_rows(logits: torch.Tensor, guides: list[tuple[int, Guide, tuple[int, ...]]]) -> None:
    """Masks, in place, rows of `logits` [rows, vocab] to the tokens their guides allow: each entry (row, guide,
    drafts) masks `row` and, for a speculating sequence, the rows of its drafts' positions after it
    (Guide.fill_masks)."""
    import xgrammar as xgr

    on_device = logits.device.type != "cpu"
    vocab_size = guides[0][1].vocab_size  # one tokenizer per engine
    # Pinned on GPUs: a copy from pageable memory would wait for the step's forward, still on the device.
    bitmask = torch.empty(xgr.get_bitmask_shape(logits.shape[0], vocab_size), dtype=xgr.bitmask_dtype,
                          pin_memory=on_device)
    rows: list[int] = []
    for row, guide, drafts in guides:
        rows.extend(guide.fill_masks(bitmask, row, drafts))
    if not rows:
        return
    if on_device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    if vocab_size < logits.shape[-1]:  # the model's padding ids
        padding = logits[:, vocab_size:]
        if len(rows) == logits.shape[0]:
            padding.fill_(float("-inf"))
        else:
            padding.index_fill_(0, torch.tensor(rows).to(logits.device, non_blocking=True), float("-inf"))
