"""POST /v1/embeddings: its wire format and its answer, over an encode_only engine.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; each entry is one engine
request, so the entries of one body and those of concurrent bodies batch together in the engine. The embeddings
come back as float lists or, with encoding_format="base64", as the base64 of their little-endian float32 bytes.
`dimensions` keeps the first values of each embedding (and scales them back to unit norm when the model
normalizes), for models whose embeddings are Matryoshka representations; for any other model it is a 400 naming
the field. A server whose engine generates answers this route with a 400, as one whose engine encodes answers the
generation routes (generation.py).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, ValidationError, field_validator

from raylm.engine_client import EngineDeadError
from raylm.inputs import TokensPrompt, tokenize_prompt
from raylm.outputs import EncoderOutput
from raylm.pooling import PoolingSpec
from raylm.rl_api import MemoryReleasedError
from raylm.serving.errors import OpenAIError, bad_request, server_error
from raylm.serving.generation import ServingContext, random_id
from raylm.serving.protocol import RequestModel, _require_valid_unicode

_INPUT_SHAPE = "input must be a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True  # raylm extension: [CLS] / [SEP] and the like around each text
    user: str | None = None  # ignored: it does not change the output

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: Any) -> Any:
        try:
            given = handler(value)
        except ValidationError:
            _require_valid_unicode(value)  # when the shape is right but the text is not, that is the error
            raise ValueError(_INPUT_SHAPE) from None
        entries = [given] if isinstance(given, str) else given
        if not entries or any(not entry for entry in entries if isinstance(entry, (str, list))):
            raise ValueError("input must not be empty, nor hold an empty string or an empty token list")
        return given

    def prompts(self) -> list[str | list[int]]:
        """One entry per embedding: its text or its token ids."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str holds base64 float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def truncated(embedding: torch.Tensor, dimensions: int | None, pooling: PoolingSpec) -> torch.Tensor:
    """The first `dimensions` values of an embedding, scaled back to unit norm when the model normalizes (the
    Matryoshka way); the whole embedding when dimensions is None."""
    if dimensions is None or dimensions >= embedding.shape[-1]:
        return embedding
    embedding = embedding[:dimensions]
    return F.normalize(embedding, p=2, dim=-1) if pooling.normalize else embedding


def encoded(embedding: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(embedding.numpy().astype("<f4").tobytes()).decode("ascii")
    return embedding.tolist()


async def create_embeddings(context: ServingContext, body: EmbeddingRequest) -> EmbeddingResponse:
    """The embeddings of every entry of body.input, in order; OpenAIError for what cannot be answered."""
    context.check_model(body.model)
    pooling = context.engine.info.pooling
    if pooling is None:
        raise bad_request(f"model `{context.model_name}` generates text and does not encode: /v1/embeddings needs a "
                          "server started with encode_only=true (an encoder-only model such as BertModel is by "
                          "default)", "model", "model_not_supported")
    if body.dimensions is not None:
        try:
            pooling.check_dimensions(body.dimensions)
        except ValueError as exc:
            raise bad_request(str(exc), "dimensions", "invalid_value") from exc
    # A long text takes a while to tokenize: the loop serves other requests meanwhile.
    prompts = await asyncio.to_thread(_tokenized, context, body)
    request_id = random_id("embd-")
    context.check_engine(request_id)
    try:
        outputs = await context.engine.embed(prompts)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), "input", "invalid_value") from exc
    except MemoryReleasedError as exc:
        raise OpenAIError(503, f"the engine cannot encode while its device memory is released; resume it (POST "
                               f"/resume) first: {exc}", code="memory_released") from exc
    except RuntimeError as exc:
        if isinstance(exc, EngineDeadError) or context.engine.dead_reason is not None:
            raise server_error(503, "the engine is not running", exc, request_id, "engine_unavailable") from exc
        raise server_error(500, "encoding failed", exc, request_id) from exc
    return _response(context, body, pooling, outputs)


def _tokenized(context: ServingContext, body: EmbeddingRequest) -> list[TokensPrompt]:
    """Each entry as token ids (the engine checks their range and length)."""
    prompts = []
    for entry in body.prompts():
        try:
            _, token_ids = tokenize_prompt(entry, context.tokenizer, body.add_special_tokens)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"input: {exc}", "input", "invalid_value") from exc
        prompts.append(TokensPrompt(prompt_token_ids=token_ids))
    return prompts


def _response(context: ServingContext, body: EmbeddingRequest, pooling: PoolingSpec,
              outputs: list[EncoderOutput]) -> EmbeddingResponse:
    data = [Embedding(index=index, embedding=encoded(truncated(output.embedding, body.dimensions, pooling),
                                                     body.encoding_format))
            for index, output in enumerate(outputs)]
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return EmbeddingResponse(data=data, model=context.model_name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

