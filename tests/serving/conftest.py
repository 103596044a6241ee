"""The OpenAI server over the real embedded SmolLM2 engine, run by uvicorn on a free port in a thread."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import uvicorn

from raylm import LLM, CompletionOutput, KvCacheConfig, RequestOutput, SamplingParams
from raylm.serving import LocalEngine, ServingConfig, build_app
from raylm.serving.engine_stream import ChunkEncoder, OutputChunk, outputs_only_grow

MODEL = "smollm2-test"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(base_url: str, process, log: Path, seconds: float = 240) -> None:
    """Waits until the server that `process` (a `raylm serve` subprocess writing to `log`) runs answers /health
    with 200; fails with the log's tail if the process exits or the time runs out first."""
    import httpx2

    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, f"raylm serve exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"raylm serve did not come up:\n{log.read_text()[-3000:]}"
        try:
            if httpx2.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.5)


@contextmanager
def ray_served(config, num_cpus: int) -> Iterator[str]:
    """Serves the Ray Serve app of `config` (ServeArgs) on a local Ray cluster of its own until the block ends;
    yields its URL."""
    import ray
    from ray import serve as ray_serve

    from raylm.serving.ray_serve import start_server

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield start_server(config).url
    finally:
        ray_serve.shutdown()
        ray.shutdown()


@contextmanager
def serve(app) -> Iterator[str]:
    """Runs app until the block ends; yields its base URL (http://127.0.0.1:PORT)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def openai_client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a test that expects a 429 or a 5xx must see it, not a retry's answer.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def used_blocks(llm: LLM) -> int:
    """KV blocks in use once the engine is idle: the last iteration of a fresh one-token request."""
    llm.get_stats(timeout=0)
    llm.generate("x", SamplingParams(max_tokens=1))
    return llm.get_stats(timeout=1)[-1]["kvCacheStats"]["usedNumBlocks"]


def check_long_stream_sends_only_new_parts(client: openai.OpenAI, model: str, max_tokens: int = 256) -> None:
    """A long greedy completion, streamed: its chunks' texts concatenate to the non-streamed text, and each chunk
    carries only its new text and tokens. A server that sent whole texts again, or diffed what was already a
    diff, would fail one or the other. (A chunk may carry several tokens: the engine deployment merges those that
    queue up behind a slow send.)"""
    kwargs = dict(model=model, prompt="Count to one thousand:", max_tokens=max_tokens, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    choices = [chunk.choices[0] for chunk in client.completions.create(stream=True, **kwargs)]
    assert "".join(choice.text for choice in choices) == whole.text and len(whole.text) > max_tokens
    tokens = [len(choice.logprobs.tokens) for choice in choices]
    assert sum(tokens) == max_tokens and len(choices) > 1
    assert [token for choice in choices for token in choice.logprobs.tokens] == whole.logprobs.tokens


def encoded(llm, prompt, params: SamplingParams) -> tuple[list[RequestOutput], list[OutputChunk]]:
    """Every output of a streamed request, and its chunks as the engine deployment sends them (pickled)."""

    async def run() -> tuple[list, list]:
        encoder, outputs, chunks = ChunkEncoder(outputs_only_grow(params)), [], []
        async for output in llm.generate_async(prompt, params, streaming=True):
            outputs.append(output)
            chunks.append(pickle.loads(pickle.dumps(encoder.encode(output))))
        return outputs, chunks

    return asyncio.run(run())


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(kv_cache_config=KvCacheConfig(max_tokens=4096), max_seq_len=1024) as engine:
        yield engine


@pytest.fixture(scope="module")
def base_url(llm) -> Iterator[str]:
    with serve(build_app(LocalEngine(llm), ServingConfig(served_model_name=MODEL))) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai_client(base_url)


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def code_running_payload(command: str) -> str:
    """A base64 weight payload whose unpickling would run the shell command: the workers must refuse it."""
    return base64.b64encode(pickle.dumps(_RunsCommand(command))).decode("ascii")


# A chat template in the Hermes / Qwen2.5 form that renders the tools offered, earlier tool calls and tool results
# (SmolLM2's own template renders none of them).
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class _RecordedGeneration:
    """A recorded output, sent one token per chunk as the engine would (so chunks end inside tags)."""

    def __init__(self, text: str, tokenizer, prompt: dict):
        self._ids = tokenizer.encode(text, add_special_tokens=False)
        self._tokenizer = tokenizer
        self._prompt = prompt

    async def admitted(self) -> None:
        pass

    async def _chunks(self):
        for position, token in enumerate(self._ids):
            text = self._tokenizer.decode(self._ids[:position + 1])[len(self._tokenizer.decode(self._ids[:position])):]
            last = position == len(self._ids) - 1
            first = position == 0
            yield OutputChunk(
                request_id="recorded", finished=last, num_cached_tokens=0, metrics={}, first=first,
                completions=[CompletionOutput(index=0, text=text, token_ids=[token],
                                              finish_reason="stop" if last else None)],
                prompt=self._prompt.get("prompt") if first else None,
                prompt_token_ids=self._prompt["prompt_token_ids"] if first else None)

    def __aiter__(self):
        return self._chunks()

    def abort(self) -> None:
        pass


class RecordedEngine(LocalEngine):
    """The engine of an LLM whose generation answers with `next_output` instead (a model output recorded in the
    form a tool-calling or reasoning model writes it); keeps the sampling parameters it was given."""

    def __init__(self, llm: LLM):
        super().__init__(llm)
        self.next_output = ""
        self.submitted: list[SamplingParams] = []

    def stream(self, inputs, sampling_params, priority, cache_salt, each_step=True, lora_request=None):
        self.submitted.append(sampling_params)
        return _RecordedGeneration(self.next_output, self.tokenizer, inputs)


def listening_processes(port: int) -> set[str]:
    """Names of the processes listening on port: one, or two HAProxy processes while one reloads and hands its
    socket to the next."""
    import psutil

    return {psutil.Process(connection.pid).name() for connection in psutil.net_connections("tcp")
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port}
