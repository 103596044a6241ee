"""POST /v1/chat/completions: a conversation rendered by the chat template, n choices, logprobs, streaming;
structured output (guided_decoding.py), tools (tools.py) and the reading of the output into reasoning, content and
tool calls (chat_output.py) when the server has a reasoning or tool-call parser."""

from __future__ import annotations

from collections.abc import AsyncIterator

from raylm.inputs import PromptInputs
from raylm.outputs import CompletionOutput, RequestOutput
from raylm.sampling_params import SamplingParams
from raylm.serving.chat import message_dicts
from raylm.serving.chat_output import ChoiceReader
from raylm.serving.generation import GenerationRoute, ServingContext, chunk_events, finish_reason
from raylm.serving.guided_decoding import guided_decoding, request_constraints
from raylm.serving.logprobs import token_text, top_ranked
from raylm.serving.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)
from raylm.serving.reasoning_parsers import THINK_CLOSE
from raylm.serving.response_stream import ChoiceDelta, ResponseStream
from raylm.serving.tools import tool_use


class ChatCompletionRoute(GenerationRoute):
    """One chat completion request's prompt and response."""

    id_prefix = "chatcmpl-"
    body: ChatCompletionRequest

    def __init__(self, context: ServingContext, body: ChatCompletionRequest):
        super().__init__(context, body)
        self.tools = tool_use(body, context.config.tool_call_parser)
        self._readers: dict[int, ChoiceReader] = {}  # a streamed choice's, by its index

    def prompts(self) -> list[PromptInputs]:
        return [self.context.chat_prompt(message_dicts(self.body.messages), self.body.add_generation_prompt,
                                         self.tools.offered)]

    def sampling_params(self, prompts: list[PromptInputs]) -> SamplingParams:
        body = self.body
        constraints = request_constraints(body)
        if self.tools.constraint is not None:
            constraints.append(self.tools.constraint)
        # With a reasoning parser the thinking is free and the answer constrained.
        begin_after = THINK_CLOSE if self.context.config.reasoning_parser is not None else None
        return body.sampling_params(self.context.max_tokens(body.requested_max_tokens, prompts[0]),
                                    logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                    guided_decoding=guided_decoding(constraints, begin_after))

    def _reader(self, prompt: str | None) -> ChoiceReader:
        return ChoiceReader(self.context.config.reasoning_parser, self.tools, prompt)

    def response(self, outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        choices = []
        for completion in outputs[0].outputs:
            reader = self._reader(outputs[0].prompt)
            choices.append(ChatChoice(index=completion.index, message=reader.message(completion.text),
                                      logprobs=self._logprobs(completion),
                                      finish_reason=reader.finish_reason(finish_reason(completion)),
                                      stop_reason=completion.stop_reason))
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.context.model_name,
                                      choices=choices, usage=usage)

    def events(self, stream: ResponseStream) -> AsyncIterator[str]:
        return chunk_events(stream, self.body, self._chunk, self._delta_choice)

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.context.model_name,
                                   choices=choices, usage=usage)

    def _delta_choice(self, delta: ChoiceDelta) -> ChatStreamChoice:
        completion = delta.completion
        reader = self._readers.get(completion.index)
        if reader is None:
            reader = self._readers[completion.index] = self._reader(delta.request.prompt)
        fields = reader.feed(completion.text, completion.finished).fields()
        if delta.is_first:
            fields = {"role": "assistant", "content": "", **fields}
        return ChatStreamChoice(index=completion.index, delta=fields,
                                finish_reason=reader.finish_reason(finish_reason(completion)),
                                stop_reason=completion.stop_reason, logprobs=self._logprobs(completion))

    def _logprobs(self, completion: CompletionOutput) -> ChatLogprobs | None:
        """The logprobs of `completion`'s tokens (whole, or a stream's new part), when asked for."""
        if not self.body.logprobs or completion.logprobs is None:
            return None
        tokenizer, num_top = self.context.tokenizer, self.body.top_logprobs or 0
        content = []
        for token, entry in zip(completion.token_ids, completion.logprobs):
            chosen = entry[token]
            text = token_text(tokenizer, token, chosen)
            tops = [_top(token_text(tokenizer, top, logprob), logprob.logprob)
                    for top, logprob in top_ranked(entry, num_top)]
            content.append(ChatTokenLogprob(token=text, logprob=chosen.logprob, bytes=list(text.encode("utf-8")),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
