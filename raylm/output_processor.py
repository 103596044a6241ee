"""Driver-side output processing: incremental detokenization, stop strings, logprobs, RequestOutput.

The engine sends token ids; everything that is text happens here. When a sequence's text reaches a stop
string, the text is cut there and the engine is told to end that sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from raylm.engine.messages import RequestDelta, SequenceDelta, TokenLogprob
from raylm.outputs import CompletionOutput, EncoderOutput, Logprob, RequestOutput, TokenLogprobs
from raylm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns a stream of token ids into text chunks, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend_tokenizer
        # A few prompt tokens give the decoder the context that decides leading spaces.
        self.stream = DecodeStream(ids=prompt_token_ids[-6:], skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: TokenLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0  # characters of text already reported (streaming diffs)
    sent_tokens: int = 0
    sent_logprobs: int = 0
    stop_checked: int = 0  # characters of text already searched for stop strings
    # (index of the first token, weight version) of each run of tokens produced by one version of the weights
    weight_versions: list[tuple[int, int]] = field(default_factory=list)


class RequestState:
    """Everything the driver knows about one request while it runs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Any, stream_each_step: bool):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.stream_each_step = stream_each_step and (params.best_of is None or params.best_of == params.n)
        self.sequences: dict[int, SequenceState] = {}
        self.prompt_logprobs: TokenLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.finished = False
        self.error: str | None = None
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    # ------------------------------------------------------------------ applying deltas

    def _sequence(self, index: int) -> SequenceState:
        if index not in self.sequences:
            detokenizer = None
            if self.params.detokenize and self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids,
                                                     self.params.skip_special_tokens)
            logprobs = [] if self.params.logprobs is not None else None
            self.sequences[index] = SequenceState(index, detokenizer, logprobs=logprobs)
        return self.sequences[index]

    def apply(self, delta: RequestDelta, weight_version: int = 0) -> list[tuple[str, int]]:
        """Folds an engine delta in (its tokens produced by weights of `weight_version`); returns the (request id,
        index) of sequences that hit a stop string."""
        self.num_cached_tokens = delta.num_cached_tokens or self.num_cached_tokens
        if delta.prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._logprob_dict(token, entry) for token, entry in zip(
                self.prompt_token_ids[len(self.prompt_logprobs):], delta.prompt_logprobs))
        if delta.replace:
            self.sequences = {}
        stopped = []
        ended = False  # some sequence ended with this delta
        for seq_delta in delta.sequences:
            seq = self._sequence(seq_delta.index)
            if seq.finish_reason is not None:
                continue  # ended by a stop string; the engine's later tokens are dropped
            if seq_delta.new_token_ids and (not seq.weight_versions or seq.weight_versions[-1][1] != weight_version):
                seq.weight_versions.append((len(seq.token_ids), weight_version))
            if self._apply_sequence(seq, seq_delta):
                stopped.append((self.request_id, seq.index))
            ended = ended or seq.finish_reason is not None
        if delta.error:
            self.error = delta.error
        if self.first_token_time is None and any(s.token_ids for s in self.sequences.values()):
            self.first_token_time = time.time()
        if delta.finished or (ended and all(s.finish_reason for s in self.sequences.values())
                              and len(self.sequences) >= self.params.num_sequences):
            self.finished = True
            self.finished_time = time.time()
            for seq in self.sequences.values():
                seq.finish_reason = seq.finish_reason or "abort"
        return stopped

    def _apply_sequence(self, seq: SequenceState, delta: SequenceDelta) -> bool:
        params = self.params
        ends_on_stop_token = delta.finish_reason == "stop" and not params.include_stop_str_in_output
        for position, token in enumerate(delta.new_token_ids):
            seq.token_ids.append(token)
            is_last = position == len(delta.new_token_ids) - 1
            if seq.detokenizer is not None and not (is_last and ends_on_stop_token):
                seq.text += seq.detokenizer.step(token)
            if seq.logprobs is not None and delta.new_logprobs:
                seq.logprobs.append(self._logprob_dict(token, delta.new_logprobs[position]))
        seq.cumulative_logprob = delta.cumulative_logprob
        if params.stop and seq.detokenizer is not None and self._check_stop_strings(seq):
            return True
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    def _check_stop_strings(self, seq: SequenceState) -> bool:
        start = max(0, seq.stop_checked - self.max_stop_len + 1)
        seq.stop_checked = len(seq.text)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            found = seq.text.find(stop, start)
            if found != -1 and (best is None or found < best[0]):
                best = (found, stop)
        if best is None:
            return False
        found, stop = best
        seq.text = seq.text[: found + len(stop)] if self.params.include_stop_str_in_output else seq.text[:found]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _logprob_dict(self, token: int, entry: TokenLogprob) -> dict[int, Logprob]:
        logprob, rank, top_ids, top_logprobs = entry
        result = {token: Logprob(logprob, rank, self._decode_one(token))}
        for position, (top_id, top_logprob) in enumerate(zip(top_ids or [], top_logprobs or [])):
            if top_id not in result:
                result[top_id] = Logprob(top_logprob, position + 1, self._decode_one(top_id))
        return result

    def _decode_one(self, token: int) -> str | None:
        if self.tokenizer is None or not self.params.detokenize:
            return None
        return self.tokenizer.decode([token])

    # ------------------------------------------------------------------ snapshots

    def _visible_text(self, seq: SequenceState) -> str:
        """Text a snapshot may show: while a sequence runs, its last characters could still turn out to be
        the start of a stop string (which the final text leaves out), so they wait."""
        if seq.finish_reason is not None or self.max_stop_len <= 1:
            return seq.text
        return seq.text[: max(seq.sent_text, len(seq.text) - (self.max_stop_len - 1))]

    def snapshot(self) -> RequestOutput:
        """The request's state now; diffs cover what changed since the previous snapshot."""
        sequences = sorted(self.sequences.values(), key=lambda s: s.index)
        if self.finished and len(sequences) > self.params.n:
            sequences = sorted(sequences, key=lambda s: -s.cumulative_logprob)[: self.params.n]
        outputs = []
        for position, seq in enumerate(sequences):
            text = self._visible_text(seq)
            outputs.append(CompletionOutput(
                index=position,
                text=text,
                token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                text_diff=text[seq.sent_text:],
                token_ids_diff=seq.token_ids[seq.sent_tokens:],
                logprobs_diff=seq.logprobs[seq.sent_logprobs:] if seq.logprobs is not None else [],
                weight_versions=list(seq.weight_versions),
            ))
            seq.sent_text, seq.sent_tokens = len(text), len(seq.token_ids)
            seq.sent_logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self._metrics(),
        )

    def _metrics(self) -> dict[str, float]:
        """Wall-clock times (seconds since the epoch) and the latencies derived from them."""
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
            metrics["time_to_first_token"] = self.first_token_time - self.arrival_time
        if self.finished_time is not None:
            metrics["finished_time"] = self.finished_time
            metrics["e2e_latency"] = self.finished_time - self.arrival_time
            generated = max((len(s.token_ids) for s in self.sequences.values()), default=0)
            if self.first_token_time is not None and generated > 1:
                metrics["time_per_output_token"] = (self.finished_time - self.first_token_time) / (generated - 1)
        return metrics


class EncodeState:
    """An encode request while it runs: it ends with the one delta that carries its embedding (or its error). Folded
    in by the engine client as a RequestState is."""

    stream_each_step = False

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.embedding = None
        self.weight_version = 0
        self.finished = False
        self.error: str | None = None

    def apply(self, delta: RequestDelta, weight_version: int = 0) -> list[tuple[str, int]]:
        """Folds the engine's delta in; returns no stopped sequences (an encode request generates none)."""
        self.finished = delta.finished
        if delta.error is not None:
            self.error = delta.error
        elif delta.finished and delta.embedding is None:
            self.error = "the request ended without an embedding"
        self.embedding = delta.embedding
        self.weight_version = weight_version
        return []

    def snapshot(self) -> EncoderOutput:
        return EncoderOutput(self.request_id, self.prompt, self.prompt_token_ids, self.embedding, self.weight_version)
