"""Following requests: a client that disconnects (streaming or not) aborts its request and frees its KV
blocks, and many concurrent streaming clients all get correct, complete outputs (a request the engine fails:
test_errors.py)."""

from __future__ import annotations

import asyncio
import time

import httpx2
import openai

from tests.conftest import PROMPTS
from tests.serving.conftest import MODEL, used_blocks

# Without an abort, this request would run for far longer than the tests wait for its blocks.
LONG = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 900, "ignore_eos": True}


def _wait_for_free_blocks(llm, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while used_blocks(llm) != 0:
        assert time.monotonic() < deadline, "the disconnected client's request still holds KV blocks"
        time.sleep(0.2)


def test_disconnecting_mid_stream_aborts_the_request_and_frees_its_blocks(base_url, llm):
    with httpx2.Client(timeout=60) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
    _wait_for_free_blocks(llm)


def test_a_non_streaming_client_that_gives_up_aborts_its_request(base_url, llm):
    try:
        httpx2.post(f"{base_url}/v1/completions", json=LONG, timeout=1.5)
        raise AssertionError("the long request finished before the client's timeout")
    except httpx2.TimeoutException:
        pass
    _wait_for_free_blocks(llm)


def test_fifty_concurrent_streaming_clients_get_the_greedy_reference_outputs(client):
    prompts = (PROMPTS[:10] * 5)[:50]
    references = {prompt: client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                    temperature=0).choices[0].text for prompt in set(prompts)}

    async def stream_all() -> list[tuple[str, str | None]]:
        async_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0,
                                          timeout=120)

        async def one(prompt: str) -> tuple[str, str | None]:
            text, reason = "", None
            async for chunk in await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                                      temperature=0, stream=True):
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        try:
            return await asyncio.gather(*(one(prompt) for prompt in prompts))
        finally:
            await async_client.close()

    outputs = asyncio.run(stream_all())
    assert [text for text, _ in outputs] == [references[prompt] for prompt in prompts]
    assert all(reason in ("stop", "length") for _, reason in outputs)


def test_a_response_that_is_not_streamed_takes_one_chunk_from_the_engine(llm):
    """Only a streamed response reads every step: the other gets the request's last output alone, the same
    tokens and text, with the engine's first-token time behind it."""
    from raylm import SamplingParams
    from raylm.serving.engine import LocalEngine
    from raylm.serving.metrics import RequestTimer, ServingMetrics
    from raylm.serving.response_stream import RequestProgress

    engine = LocalEngine(llm)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def chunks(each_step: bool) -> list:
        return [chunk async for chunk in engine.stream({"prompt": PROMPTS[0]}, params, 0.0, None, each_step)]

    steps = asyncio.run(chunks(True))
    timer = RequestTimer(ServingMetrics(MODEL))
    last = asyncio.run(chunks(False))
    assert len(steps) > 1 and len(last) == 1 and last[0].finished
    assert last[0].completions[0].token_ids == [t for chunk in steps for t in chunk.completions[0].token_ids]
    assert last[0].completions[0].text == "".join(chunk.completions[0].text for chunk in steps)

    progress = RequestProgress(0)
    progress.add(last[0])
    timer.observe(progress)
    metrics = last[0].metrics
    assert timer.submitted <= timer.first_token
    assert time.perf_counter() - timer.first_token >= metrics["finished_time"] - metrics["first_token_time"] - 1e-3
