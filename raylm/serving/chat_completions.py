"""POST /v1/chat/completions: a conversation rendered by the chat template, n choices, logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from raylm.inputs import TokensPrompt
from raylm.outputs import Logprob
from raylm.results import GenerationResult
from raylm.serving.chat import message_dicts, render_chat
from raylm.serving.errors import OpenAIError, from_engine_error
from raylm.serving.generation import (
    SSE_DONE,
    ServingContext,
    UsageTally,
    finish_reason,
    random_id,
    sse,
    stream_deltas,
    token_text,
    top_ranked,
    unix_time,
    unless_disconnected,
)
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
)

_FIELDS = tuple(ChatCompletionRequest.model_fields)


async def create_chat_completion(context: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    context.check_model(body.model)
    prompt_text, prompt_ids = render_chat(context.tokenizer, message_dicts(body.messages),
                                          context.config.chat_template, body.add_generation_prompt)
    max_tokens = body.requested_max_tokens
    if max_tokens is None:  # OpenAI's default: as many as the context leaves
        max_tokens = max(1, context.max_seq_len - len(prompt_ids))
    try:
        params = body.sampling_params(max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    except (ValueError, TypeError) as exc:
        raise from_engine_error(exc, _FIELDS) from exc
    prompt = TokensPrompt(prompt_token_ids=prompt_ids, prompt=prompt_text)
    results = await context.submit([prompt], params, body.priority, body.cache_salt, _FIELDS)
    response_id, created = random_id("chatcmpl-"), unix_time()
    if body.stream:
        return StreamingResponse(_stream(context, body, results, response_id, created),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    output = (await unless_disconnected(request, context.final_outputs(results)))[0]
    tally = UsageTally()
    tally.update(0, output)
    choices = [
        ChatChoice(index=completion.index, message=ChatResponseMessage(content=completion.text),
                   logprobs=_logprobs(context, body, completion.token_ids, completion.logprobs),
                   finish_reason=finish_reason(completion), stop_reason=completion.stop_reason)
        for completion in output.outputs
    ]
    response = ChatCompletionResponse(id=response_id, created=created, model=context.model_name, choices=choices,
                                      usage=tally.usage())
    return JSONResponse(response.model_dump())


async def _stream(context: ServingContext, body: ChatCompletionRequest, results: Sequence[GenerationResult],
                  response_id: str, created: int) -> AsyncIterator[str]:
    tally = UsageTally()

    def chunk(choices: list[ChatStreamChoice], usage: object = None) -> str:
        return sse(ChatCompletionChunk(id=response_id, created=created, model=context.model_name, choices=choices,
                                       usage=usage))

    try:
        async for delta in stream_deltas(context, results):
            tally.update(delta.prompt_index, delta.output)
            completion = delta.completion
            content = {"role": "assistant", "content": delta.text} if delta.is_first else (
                {"content": delta.text} if delta.text else {})
            new_logprobs = completion.logprobs[delta.first_token:] if completion.logprobs is not None else None
            choice = ChatStreamChoice(
                index=completion.index, delta=content, finish_reason=delta.finish_reason,
                stop_reason=completion.stop_reason,
                logprobs=_logprobs(context, body, completion.token_ids[delta.first_token:], new_logprobs),
            )
            yield chunk([choice], tally.usage() if body.continuous_usage else None)
        if body.include_usage:
            yield chunk([], tally.usage())
    except OpenAIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


def _logprobs(context: ServingContext, body: ChatCompletionRequest, token_ids: list[int],
              entries: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
    if not body.logprobs or entries is None:
        return None
    tokenizer, num_top = context.tokenizer, body.top_logprobs or 0
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = token_text(tokenizer, token, chosen)
        tops = [_top(token_text(tokenizer, top, logprob), logprob.logprob)
                for top, logprob in top_ranked(entry, num_top)]
        content.append(ChatTokenLogprob(token=text, logprob=chosen.logprob, bytes=list(text.encode("utf-8")),
                                        top_logprobs=tops))
    return ChatLogprobs(content=content)


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
