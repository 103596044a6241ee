"""POST /v1/chat/completions: a conversation rendered by the chat template, n choices, logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from raylm.inputs import PromptInputs
from raylm.outputs import CompletionOutput, RequestOutput
from raylm.sampling_params import SamplingParams
from raylm.serving.chat import message_dicts
from raylm.serving.generation import GenerationRoute, chunk_events, finish_reason
from raylm.serving.logprobs import token_text, top_ranked
from raylm.serving.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)
from raylm.serving.response_stream import ChoiceDelta, ResponseStream


class ChatCompletionRoute(GenerationRoute):
    """One chat completion request's prompt and response."""

    id_prefix = "chatcmpl-"
    body: ChatCompletionRequest

    def prompts(self) -> list[PromptInputs]:
        return [self.context.chat_prompt(message_dicts(self.body.messages), self.body.add_generation_prompt)]

    def sampling_params(self, prompts: list[PromptInputs]) -> SamplingParams:
        body = self.body
        return body.sampling_params(self.context.max_tokens(body.requested_max_tokens, prompts[0]),
                                    logprobs=(body.top_logprobs or 0) if body.logprobs else None)

    def response(self, outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=completion.index, message=ChatResponseMessage(content=completion.text),
                       logprobs=self._logprobs(completion), finish_reason=finish_reason(completion),
                       stop_reason=completion.stop_reason)
            for completion in outputs[0].outputs
        ]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.context.model_name,
                                      choices=choices, usage=usage)

    def events(self, stream: ResponseStream) -> AsyncIterator[str]:
        return chunk_events(stream, self.body, self._chunk, self._delta_choice)

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.context.model_name,
                                   choices=choices, usage=usage)

    def _delta_choice(self, delta: ChoiceDelta) -> ChatStreamChoice:
        completion = delta.completion
        if delta.is_first:
            content = {"role": "assistant", "content": completion.text}
        else:
            content = {"content": completion.text} if completion.text else {}
        return ChatStreamChoice(index=completion.index, delta=content, finish_reason=finish_reason(completion),
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
