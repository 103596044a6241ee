"""One engine replica of a batch job: a Ray Data actor (map_batches) holding one LLM.

Ray Data hands the actor several blocks at a time (ActorPoolStrategy's calls in flight per actor), each on a
thread of its own; every row of every block goes into the one engine as soon as it arrives, so the engine batches
rows across blocks continuously instead of waiting for a block's slowest row. Rows are answered through the
server's own routes (ServingContext.answer), so a batch answer is the body `raylm serve` would send.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Any

from pydantic import ValidationError

from raylm.batch.rows import BATCH_URLS, KEY, LINE, OUTPUT_COLUMNS, is_batch_request, json_safe
from raylm.serving.errors import OpenAIError, bad_request, from_validation_errors

logger = logging.getLogger(__name__)


def _request_fields() -> frozenset[str]:
    """The request fields a table row's columns may set (those of completions and chat, but the prompt's own)."""
    from raylm.serving.protocol import ChatCompletionRequest, CompletionRequest

    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return frozenset(fields - {"model", "prompt", "messages", "stream", "stream_options"})


class BatchReplica:
    """Answers blocks of (key, JSON text) rows with one engine. `llm_options` are LLM's arguments; `defaults` the
    request fields every table row starts from."""

    def __init__(self, llm_options: dict[str, Any], served_model_name: str, chat_template: str | None,
                 defaults: dict[str, Any]):
        from raylm import LLM
        from raylm.serving.config import ServingConfig
        from raylm.serving.engine import LocalEngine
        from raylm.serving.generation import ServingContext
        from raylm.serving.metrics import ServingMetrics

        self.llm = LLM(**llm_options)
        config = ServingConfig(served_model_name=served_model_name, chat_template=chat_template)
        self.context = ServingContext(LocalEngine(self.llm), config, ServingMetrics(served_model_name))
        self.defaults = dict(defaults)
        self.request_fields = _request_fields()
        self._rows_in_flight = 0  # rows of all the blocks the engine is answering now
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="batch-replica-loop", daemon=True).start()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        keys, lines = list(batch[KEY]), list(batch[LINE])
        started = time.time()
        with self._lock:
            self._rows_in_flight += len(keys)
            in_flight = self._rows_in_flight
        try:
            answers = asyncio.run_coroutine_threadsafe(self._answer_all(keys, lines), self.loop).result()
        finally:
            with self._lock:
                self._rows_in_flight -= len(keys)
        finished = time.time()
        return {
            KEY: keys,
            LINE: [json.dumps(json_safe(answer), ensure_ascii=False) for answer, _ in answers],
            "failed": [usage is None for _, usage in answers],
            "input_tokens": [usage[0] if usage else 0 for _, usage in answers],
            "generated_tokens": [usage[1] if usage else 0 for _, usage in answers],
            # For the job's summary: the most rows answered at once, and when the replicas were answering.
            "rows_in_flight": [in_flight] * len(keys),
            "started": [started] * len(keys),
            "finished": [finished] * len(keys),
        }

    async def _answer_all(self, keys: list[str], lines: list[str]) -> list[tuple[dict, tuple[int, int] | None]]:
        return list(await asyncio.gather(*(self._answer(key, line) for key, line in zip(keys, lines))))

    async def _answer(self, key: str, line: str) -> tuple[dict, tuple[int, int] | None]:
        """One row's answer, and its (prompt, generated) token counts, or None when it failed."""
        try:
            row = json.loads(line)
        except ValueError as error:
            row, problem = None, f"the row is not JSON: {error}"
        else:
            problem = None if isinstance(row, dict) else f"a row must be a JSON object, got {type(row).__name__}"
        if problem is not None:
            return self._table_failure({}, key, problem), None
        if is_batch_request(row):
            return await self._batch_answer(row)
        return await self._table_answer(key, row)

    # ------------------------------------------------------------------ OpenAI Batch requests

    async def _batch_answer(self, row: dict) -> tuple[dict, tuple[int, int] | None]:
        answer = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row["custom_id"], "response": None,
                  "error": None}
        url, method = row.get("url"), row.get("method", "POST")
        if method != "POST" or url not in BATCH_URLS:
            answer["error"] = {"code": "invalid_url", "message": f"a batch request must be POST to one of "
                                                                  f"{list(BATCH_URLS)}, got {method} {url}"}
            return answer, None
        body = row["body"]
        if not isinstance(body, dict):
            answer["error"] = {"code": "invalid_body", "message": "body must be a JSON object"}
            return answer, None
        status, response, usage = await self._respond(url, {"model": self.context.model_name, **body})
        answer["response"] = {"status_code": status, "request_id": answer["id"], "body": response}
        return answer, usage

    async def _respond(self, url: str, body: dict) -> tuple[int, dict, tuple[int, int] | None]:
        """(status, body, token counts) as the server answers `body` at `url`."""
        from raylm.serving.chat_completions import ChatCompletionRoute
        from raylm.serving.completions import CompletionRoute
        from raylm.serving.protocol import ChatCompletionRequest, CompletionRequest

        chat = url == "/v1/chat/completions"
        try:
            try:
                request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
            except ValidationError as error:
                raise from_validation_errors(error.errors(include_url=False)) from error
            if request.stream:
                raise bad_request("stream is not available in a batch job", "stream")
            route = (ChatCompletionRoute if chat else CompletionRoute)(self.context, request)
            response = (await self.context.answer(route)).model_dump()
        except OpenAIError as error:
            return error.status, error.body(), None
        except Exception:
            logger.exception("a batch row failed")
            return 500, OpenAIError(500, "the row failed inside the engine replica (see its log)").body(), None
        usage = response.get("usage") or {}
        return 200, response, (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    # ------------------------------------------------------------------ table rows

    async def _table_answer(self, key: str, row: dict) -> tuple[dict, tuple[int, int] | None]:
        own = row.get("sampling_params") or {}
        if not isinstance(own, dict):
            return self._table_failure(row, key, "sampling_params must be an object of request fields"), None
        fields = {**self.defaults, **own, **{name: row[name] for name in self.request_fields if name in row}}
        if "messages" in row:
            url, body = "/v1/chat/completions", {"messages": row["messages"], **fields}
        elif "prompt" in row:
            url, body = "/v1/completions", {"prompt": row["prompt"], **fields}
        else:
            return self._table_failure(row, key, "a row needs a `prompt` or `messages` column (or custom_id, url "
                                                 "and body: an OpenAI Batch request)"), None
        status, response, usage = await self._respond(url, {"model": self.context.model_name, **body})
        if status != 200:
            return self._table_failure(row, key, response["error"]["message"]), None
        choices = response["choices"]
        chat = url == "/v1/chat/completions"
        texts = [choice["message"]["content"] if chat else choice["text"] for choice in choices]
        reasons = [choice["finish_reason"] for choice in choices]
        answer = {**self._own_columns(row), "row_id": key.removeprefix("row:"),
                  "generated_text": texts[0] if len(texts) == 1 else texts,
                  "num_input_tokens": usage[0], "num_generated_tokens": usage[1],
                  "finish_reason": reasons[0] if len(reasons) == 1 else reasons, "error": None}
        if body.get("logprobs"):
            logprobs = [choice["logprobs"] for choice in choices]
            answer["logprobs"] = logprobs[0] if len(logprobs) == 1 else logprobs
        return answer, usage

    def _table_failure(self, row: dict, key: str, message: str) -> dict:
        return {**self._own_columns(row), "row_id": key.removeprefix("row:"), "generated_text": None,
                "num_input_tokens": None, "num_generated_tokens": None, "finish_reason": None, "error": message}

    @staticmethod
    def _own_columns(row: dict) -> dict:
        return {name: value for name, value in row.items() if name not in OUTPUT_COLUMNS}
