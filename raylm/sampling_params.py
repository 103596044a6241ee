"""SamplingParams: how one request is decoded.

Defaults follow the LLM API: with none of temperature / top_k / top_p / min_p given, decoding is greedy.
Every field is validated at construction; a bad value raises ValueError (or TypeError for a wrong
type) naming the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# Temperatures below this decode greedily: dividing logits by a temperature this small overflows them to inf
# (or turns them into NaN), and the draw would no longer favour the most likely token.
GREEDY_TEMPERATURE = 1e-5
# The seeds a request's torch.Generator takes: 64 bits, a negative seed standing for seed + 2**64.
SEED_RANGE = (-(2**63), 2**64 - 1)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


GUIDED_KINDS = ("json", "regex", "choice", "grammar", "lark", "json_object", "structural_tag")


@dataclass
class GuidedDecodingParams:
    """Structured output for a request: exactly one of
    - json: a JSON schema (a dict, its JSON text, or a pydantic model class) the output must validate against;
    - regex: a regular expression the whole output matches;
    - choice: a list of strings, the output being one of them;
    - grammar: an EBNF grammar (GBNF, `root ::= ...`); lark: a Lark grammar;
    - json_object: True for any JSON object;
    - structural_tag: xgrammar's structural tag (a dict or its JSON text: free text with constrained segments).
    Each is compiled with xgrammar into a token mask per step; a malformed one raises ValueError naming it.
    begin_after: text after which the constraint starts (a reasoning model's "</think>": the thinking is free, the
    answer constrained); None constrains the output from its first token."""

    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    lark: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None
    begin_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, type):  # a pydantic model class
            schema = getattr(self.json, "model_json_schema", None)
            if schema is None:
                raise TypeError(f"guided_decoding.json must be a JSON schema (dict or str) or a pydantic model "
                                f"class, got the class {self.json.__name__}")
            self.json = schema()
        given = [kind for kind in GUIDED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided_decoding takes exactly one of {list(GUIDED_KINDS)}, got "
                             f"{given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"guided_decoding.json_object must be a bool, got {type(self.json_object).__name__}")
        for kind, types, names in (("json", (str, dict), "a JSON schema (dict or str)"), ("regex", str, "a string"),
                                   ("grammar", str, "a string"), ("lark", str, "a string"),
                                   ("structural_tag", (str, dict), "a dict or a string"),
                                   ("choice", (list, tuple), "a list of strings")):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, types):
                raise TypeError(f"guided_decoding.{kind} must be {names}, got {type(value).__name__}")
        if self.begin_after is not None and (not isinstance(self.begin_after, str) or not self.begin_after):
            raise ValueError(f"guided_decoding.begin_after must be a non-empty string, got {self.begin_after!r}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("guided_decoding.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(kind for kind in GUIDED_KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: (kind, canonical text)."""
        import json

        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, str(value)


@dataclass
class SamplingParams:
    """Decoding parameters of a request.

    temperature: 0 (or below GREEDY_TEMPERATURE, 1e-5) decodes greedily; unset, it is 1.0 when top_k, top_p or
    min_p is given and greedy otherwise. seed: an integer in [-2**63, 2**64 - 1] (a negative seed stands for
    seed + 2**64, as in torch.Generator.manual_seed) makes the request's draws reproducible.
    """

    max_tokens: int = 32
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None

    logprobs: int | None = None
    prompt_logprobs: int | bool | None = None

    detokenize: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    guided_decoding: GuidedDecodingParams | None = None
    # False keeps this request out of the engine's speculative decoding (LlmArgs.speculative_config).
    use_speculative_decoding: bool = True

    # Filled from the tokenizer by the driver when end_id is not given.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 0
        elif self.prompt_logprobs is False:
            self.prompt_logprobs = None
        self._validate()

    # ---------------------------------------------------------------- validation

    def _validate(self) -> None:
        self._check_int("max_tokens", self.max_tokens, low=1)
        self._check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self._check_int("n", self.n, low=1)
        if self.best_of is not None:
            self._check_int("best_of", self.best_of, low=1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        self._check_float("temperature", self.temperature, low=0.0, optional=True)
        if self.top_k is not None:
            self._check_int("top_k", self.top_k, low=0)
        self._check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True, optional=True)
        self._check_float("min_p", self.min_p, low=0.0, high=1.0, optional=True)
        if self.seed is not None:
            self._check_int("seed", self.seed, low=SEED_RANGE[0], high=SEED_RANGE[1])
        self._check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        self._check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self._check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self._check_float("length_penalty", self.length_penalty)
        if not isinstance(self.early_stopping, (bool, str)):
            raise TypeError(f"early_stopping must be a bool, got {type(self.early_stopping).__name__} "
                            "(or the string 'never')")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        for stop in self.stop:
            if not isinstance(stop, str):
                raise TypeError(f"stop must be a string or a list of strings, got an item {stop!r}")
            if not stop:
                raise ValueError("stop strings must not be empty")
        for token_id in self.stop_token_ids:
            self._check_int("stop_token_ids", token_id, low=0)
        if self.end_id is not None:
            self._check_int("end_id", self.end_id, low=0)
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, low=0, high=20)
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=20)
        if self.truncate_prompt_tokens is not None:
            self._check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)
        if not isinstance(self.use_speculative_decoding, bool):
            raise TypeError(f"use_speculative_decoding must be a bool, got "
                            f"{type(self.use_speculative_decoding).__name__}")
        if self.guided_decoding is not None:
            if isinstance(self.guided_decoding, dict):
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise TypeError(f"guided_decoding must be a GuidedDecodingParams, got "
                                f"{type(self.guided_decoding).__name__}")
            if self.use_beam_search:
                raise ValueError("guided_decoding does not combine with use_beam_search")
        if self.use_beam_search and self.temperature is not None and self.temperature >= GREEDY_TEMPERATURE:
            raise ValueError("use_beam_search does not combine with temperature sampling; leave temperature unset")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"{f.name} must be a bool, got {type(getattr(self, f.name)).__name__}")

    @staticmethod
    def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r})")
        if low is not None and value < low:
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"{name} must be {bound}, got {value}")
        if high is not None and value > high:
            raise ValueError(f"{name} must be in [{low}, {high}], got {value}")

    @staticmethod
    def _check_float(
        name: str,
        value: object,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        optional: bool = False,
    ) -> None:
        if value is None and optional:
            return
        if not _is_number(value):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
        lower = "(" if low_open else "["
        bound = f"in {lower}{low}, {high}]" if high is not None else (f"> {low}" if low_open else f">= {low}")
        if math.isnan(value) or math.isinf(value):
            range_text = f" {bound}" if low is not None else ""
            raise ValueError(f"{name} must be a finite number{range_text}, got {value}")
        if low is not None and (value < low or (low_open and value == low)):
            raise ValueError(f"{name} must be {bound}, got {value}")
        if high is not None and value > high:
            raise ValueError(f"{name} must be {bound}, got {value}")

    # ---------------------------------------------------------------- derived views

    @property
    def is_greedy(self) -> bool:
        """True when decoding picks the most likely token every step."""
        if self.temperature is not None:
            return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
        if self.top_k == 1:
            return True
        return self.top_k is None and self.top_p is None and self.min_p is None

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature

    @property
    def beam_width(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: best_of candidates, or the beams."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a sequence: stop_token_ids plus the end ids unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update((self.end_id,) if self.end_id is not None else self._eos_token_ids)
        return frozenset(ids)
