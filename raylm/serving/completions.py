"""POST /v1/completions: text or token-id prompts (one or many), n / best_of, echo, logprobs, streaming, and
structured output (guided_decoding.py: the whole text is constrained; no reasoning is split off here).

echo with max_tokens=0 returns the prompt alone (with its logprobs when asked, as lm-eval's loglikelihood
needs): the engine generates one token, which the response leaves out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from raylm.inputs import PromptInputs
from raylm.outputs import CompletionOutput, Logprob, RequestOutput
from raylm.sampling_params import SamplingParams
from raylm.serving.generation import GenerationRoute, ServingContext, chunk_events, finish_reason
from raylm.serving.guided_decoding import guided_decoding, request_constraints
from raylm.serving.logprobs import token_text, top_ranked
from raylm.serving.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from raylm.serving.response_stream import ChoiceDelta, RequestProgress, ResponseStream


class CompletionRoute(GenerationRoute):
    """One completion request's prompts and response; keeps each choice's text offset across stream chunks."""

    id_prefix = "cmpl-"
    body: CompletionRequest

    def __init__(self, context: ServingContext, body: CompletionRequest):
        super().__init__(context, body)
        self.max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        self.prompt_only = body.echo and self.max_tokens == 0
        self._text_offsets: dict[int, int] = {}

    def prompts(self) -> list[PromptInputs]:
        return self.body.prompts()

    def sampling_params(self, prompts: list[PromptInputs]) -> SamplingParams:
        body = self.body
        return body.sampling_params(1 if self.prompt_only else self.max_tokens, best_of=body.best_of,
                                    logprobs=body.logprobs, prompt_logprobs=body.logprobs if body.echo else None,
                                    add_special_tokens=body.add_special_tokens,
                                    guided_decoding=guided_decoding(request_constraints(body)))

    def response(self, outputs: list[RequestOutput], usage: Usage) -> CompletionResponse:
        choices = [self._choice(index, output, completion, with_prompt=True)
                   for index, output in enumerate(outputs) for completion in output.outputs]
        return self._response(choices, usage)

    def events(self, stream: ResponseStream) -> AsyncIterator[str]:
        return chunk_events(stream, self.body, self._response, self._delta_choice)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        if usage is not None and self.prompt_only:  # the one generated token is not part of the response
            usage = Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens,
                          prompt_tokens_details=usage.prompt_tokens_details)
        return CompletionResponse(id=self.response_id, created=self.created, model=self.context.model_name,
                                  choices=choices, usage=usage)

    def _delta_choice(self, delta: ChoiceDelta) -> CompletionChoice:
        return self._choice(delta.prompt_index, delta.request, delta.completion, with_prompt=delta.is_first)

    def _choice(self, prompt_index: int, request: RequestOutput | RequestProgress, completion: CompletionOutput,
                with_prompt: bool) -> CompletionChoice:
        """A choice holding `completion` (whole, or a stream's new part), preceded by the request's prompt when
        echoing and with_prompt."""
        index = prompt_index * self.body.n + completion.index
        parts = [("", [], [])] if self.prompt_only else [(completion.text, completion.token_ids, completion.logprobs)]
        if self.body.echo and with_prompt:
            prompt_text = request.prompt
            if prompt_text is None:
                prompt_text = self.context.tokenizer.decode(request.prompt_token_ids)
            parts.insert(0, (prompt_text, request.prompt_token_ids, request.prompt_logprobs))
        choice_logprobs = None
        if self.body.logprobs is not None:
            choice_logprobs = CompletionLogprobs()
            for _, part_ids, part_logprobs in parts:
                self._add_logprobs(choice_logprobs, index, part_ids, part_logprobs or [])
        return CompletionChoice(index=index, text="".join(part[0] for part in parts), logprobs=choice_logprobs,
                                finish_reason=finish_reason(completion), stop_reason=completion.stop_reason)

    def _add_logprobs(self, into: CompletionLogprobs, index: int, token_ids: list[int],
                      entries: list[dict[int, Logprob] | None]) -> None:
        num_top = self.body.logprobs or 0
        offset = self._text_offsets.get(index, 0)
        for token, entry in zip(token_ids, entries):
            chosen = entry.get(token) if entry is not None else None
            text = token_text(self.context.tokenizer, token, chosen)
            into.tokens.append(text)
            into.text_offset.append(offset)
            offset += len(text)
            into.token_logprobs.append(chosen.logprob if chosen is not None else None)
            if entry is None:  # the first prompt token: nothing precedes it to predict it
                into.top_logprobs.append(None)
            else:
                # As OpenAI's legacy completions do: the sampled token is listed too, outside the top ones or not.
                tops = top_ranked(entry, num_top)
                if chosen is not None and all(top != token for top, _ in tops):
                    tops.append((token, chosen))
                into.top_logprobs.append({token_text(self.context.tokenizer, top, logprob): logprob.logprob
                                          for top, logprob in tops})
        self._text_offsets[index] = offset
