"""Release and resume on a GPU (marker gpu): the memory goes back to the device by the driver's count
(torch.cuda.mem_get_info), and greedy output after release / resume cycles, decode graphs captured again each time,
is bitwise what it was. SmolLM2-135M's shape with random weights (load_format dummy) in bfloat16, in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from raylm import AsyncLLM, SamplingParams, TokensPrompt
from raylm.engine.device_memory import TAGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "smollm2-135m"
PROMPT = TokensPrompt(prompt_token_ids=list(range(1000, 1032)))


async def _greedy(llm: AsyncLLM) -> tuple[list[int], list[float]]:
    output = await llm.generate_async(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0))
    completion = output.outputs[0]
    return list(completion.token_ids), [step[token].logprob for step, token in
                                        zip(completion.logprobs, completion.token_ids)]


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_per_tensor"])
@pytest.mark.parametrize("keep_addresses", [False, True], ids=["reallocate", "keep_addresses"])
def test_release_returns_the_memory_and_three_cycles_keep_greedy_output_bitwise(keep_addresses, kv_dtype):
    """An FP8 cache stores its values by slots, which decode reads a run of 16 at a time, unwritten slots too
    (weight 0): they come back zeroed from every resume, reallocated or at the same addresses; per-tensor scales
    (fp8_scales='per_tensor') come back set."""
    if keep_addresses:
        pytest.importorskip("torch_memory_saver")

    async def scenario():
        llm = AsyncLLM(model=str(MODEL), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                       device="cuda", executor="local", max_batch_size=8, max_seq_len=512,
                       kv_cache_config={"max_tokens": 65536, "dtype": kv_dtype.removesuffix("_per_tensor"),
                                        "fp8_scales": "per_tensor" if "per_tensor" in kv_dtype else "per_token"},
                       sleep_config={"keep_addresses": keep_addresses})
        await llm
        worker = llm._executor.worker
        try:
            assert worker.memory_status()["keep_addresses"] is keep_addresses
            assert worker.runner.graphs is not None  # decode graphs on
            reference = await _greedy(llm)
            for _ in range(3):
                await llm.pause_generation()
                held = sum(entry["bytes"] for entry in worker.memory_status()["tags"].values())
                before = _free()
                await llm.release(list(TAGS))
                returned = _free() - before
                assert returned >= 0.99 * held, (
                    f"released {returned} of {held} bytes; the allocator still has {torch.cuda.memory_allocated()} "
                    f"allocated, {torch.cuda.memory_reserved()} reserved")
                with pytest.raises(ValueError, match="resume"):
                    llm.generate_async(PROMPT, SamplingParams(max_tokens=2))
                await llm.resume(list(TAGS))
                if kv_dtype != "auto":
                    assert all(layer[1].stride(1) == 1 and layer[1].view(torch.uint8).count_nonzero() == 0
                               for layer in worker.runner.kv_caches)
                await llm.resume_generation()
                assert worker.runner.graphs is not None
                assert await _greedy(llm) == reference  # tokens and logprobs, bit for bit

            await llm.pause_generation()
            for tag in ("kv_cache", "model_weights"):  # the large ones: the allocator's 2 MiB pages do not blur them
                held = worker.memory_status()["tags"][tag]["bytes"]
                before = _free()
                await llm.release([tag])
                assert _free() - before >= 0.99 * held, tag
            await llm.resume(list(TAGS))
            await llm.resume_generation()
            assert await _greedy(llm) == reference
        finally:
            llm.shutdown()

    asyncio.run(scenario())
