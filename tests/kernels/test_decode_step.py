"""One decode step of a tiny model on raylm's GPU paths (the Triton GEMV, the Triton attention metadata, the
decode graphs' static buffers) against the same step on the reference path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import MODULE_MARKS, kernel_device, tiny_runner

DEVICE = kernel_device()
pytestmark = MODULE_MARKS

from raylm.engine.model_runner import ModelRunner  # noqa: E402
from raylm.engine.step_plan import StepPlan  # noqa: E402
from raylm.kernels.policy import KernelPolicy  # noqa: E402


def _decode_hidden(runner: ModelRunner, cache: list[tuple[torch.Tensor, torch.Tensor]],
                   lora_slots: list[int] | None = None) -> torch.Tensor:
    """Final hidden states of one decode step of two sequences over a cache holding random keys and values (with
    a LoRA runtime on the runner: the rows' adapter slots)."""
    runner.kv_caches = [(k.clone(), v.clone()) for k, v in cache]
    plan = StepPlan(input_ids=[5, 9], positions=[19, 4], slot_mapping=[2 * 16 + 3, 3 * 16 + 4],
                    decode_contexts=[([1, 2], 20), ([3], 5)], sample_rows=[0, 1], lora_slots=lora_slots or [])
    return runner.forward(plan).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a bias on the qkv projection
def test_decode_linear_layers_through_the_gemv_match_the_reference(tiny_model_dirs, arch, monkeypatch):
    """kernel_config.decode_gemv: a decode step's linear layers (qkv, o, gate_up, down, LM head) go to the Triton
    GEMV (taken here for every layer, whatever the device)."""
    runner, loaded = tiny_runner(tiny_model_dirs[arch], torch.float16, DEVICE)
    generator = torch.Generator().manual_seed(0)
    cache = [(torch.randn(k.shape, generator=generator).to(DEVICE, k.dtype),
              torch.randn(v.shape, generator=generator).to(DEVICE, v.dtype)) for k, v in runner.kv_caches]

    reference = _decode_hidden(runner, cache)
    calls = []
    monkeypatch.setattr(KernelPolicy, "gemv_applies", lambda self, x, weight: calls.append(x.shape) or True)
    through_gemv = _decode_hidden(runner, cache)

    assert len(calls) >= 4 * loaded.arch.num_layers  # qkv, o, gate_up and down of every layer
    assert torch.isfinite(through_gemv).all()
    torch.testing.assert_close(through_gemv, reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms before the rotation
def test_triton_attention_path_matches_torch_path(tiny_model_dirs, arch):
    """A decode step through the Triton metadata (rotation fused into the cache write, paged attention) against
    the torch metadata (rotation, cache write and attention in torch), float32."""
    from raylm.kernels.attention import build_metadata
    from raylm.kernels.triton_backend import build_triton_metadata

    runner, _ = tiny_runner(tiny_model_dirs[arch], torch.float32, DEVICE)
    generator = torch.Generator().manual_seed(1)
    cache = [tuple(torch.randn(t.shape, generator=generator).to(DEVICE) for t in pair) for pair in runner.kv_caches]
    runner.build_metadata = build_metadata
    torch_path = _decode_hidden(runner, cache)
    torch_cache = runner.kv_caches
    runner.build_metadata = build_triton_metadata
    triton_path = _decode_hidden(runner, cache)
    torch.testing.assert_close(triton_path, torch_path, atol=1e-4, rtol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(runner.kv_caches, torch_cache):  # the new keys went in rotated, alike
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


def test_graph_buffers_give_the_eager_step(tiny_model_dirs):
    """DecodeGraphs.run refills its static buffers (one copy for ids, positions, slots and lengths; the block
    table) and runs the forward over them; on the CPU it runs uncaptured, which checks the buffers: padded to the
    ladder's next size, the step equals the eager one, three times in a row (both staging sets); so do its logits
    (in the graphs' shared buffer) and, when asked for, its greedy draws."""
    from raylm.engine.cuda_graphs import DecodeGraphs
    from raylm.kernels.triton_backend import build_triton_metadata

    runner, loaded = tiny_runner(tiny_model_dirs["llama"], torch.float32, DEVICE)
    runner.build_metadata = build_triton_metadata
    generator = torch.Generator().manual_seed(2)
    cache = [tuple(torch.randn(t.shape, generator=generator).to(DEVICE) for t in pair) for pair in runner.kv_caches]
    eager = _decode_hidden(runner, cache)
    runner.kv_caches = [(k.clone(), v.clone()) for k, v in cache]
    with torch.inference_mode():
        eager_logits = loaded.model.compute_logits(eager.to(runner.dtype)).float()
    graphs = DecodeGraphs(loaded.model, runner.kv_caches, [1, 4], 8, loaded.arch.hidden_size, torch.float32,
                          DEVICE, None, logits=True)
    for greedy in (True, False, True):
        step = graphs.run_step([5, 9], [19, 4], [2 * 16 + 3, 3 * 16 + 4], [([1, 2], 20), ([3], 5)], greedy=greedy)
        assert step.hidden.shape[0] == 2 and step.logits.shape == eager_logits.shape
        torch.testing.assert_close(step.hidden.float(), eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step.logits.float(), eager_logits, atol=1e-4, rtol=1e-4)
        assert step.logits.data_ptr() == graphs.logits_buffer.data_ptr()
        if not greedy:
            assert step.greedy is None
            continue
        tokens, logprobs = step.greedy
        assert tokens.tolist() == eager_logits.argmax(dim=-1).tolist()
        torch.testing.assert_close(logprobs, eager_logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0])


def test_graph_buffers_take_each_row_s_lora_slot(tiny_model_dirs, tiny_lora_dirs):
    """Decode graphs of a model with LoRA adapters: each step writes its rows' slots into the graphs' buffer
    (padding rows -1), and the step equals the eager one with the same adapters, for three mixes of adapters in a
    row; a step without adapters takes the graphs without the LoRA kernels and equals the base model's. On CUDA the
    graphs are captured first: the adapted layers' Triton kernels read the buffer inside them."""
    from raylm.config import LoraConfig
    from raylm.engine.cuda_graphs import DecodeGraphs
    from raylm.kernels.policy import set_kernel_policy
    from raylm.kernels.triton_backend import build_triton_metadata
    from raylm.lora_request import LoRARequest
    from raylm.models.lora import LoraRuntime

    runner, loaded = tiny_runner(tiny_model_dirs["llama"], torch.float32, DEVICE)
    runner.build_metadata = build_triton_metadata
    runner.lora = LoraRuntime(loaded.model, loaded.arch, LoraConfig(max_loras=2, max_lora_rank=64), torch.float32,
                              DEVICE)
    set_kernel_policy(loaded.model, runner.kernels)  # the adapters' layers, made after the runner
    for slot, name in enumerate(("r8", "qv")):
        runner.lora.load(slot, LoRARequest(name, slot + 1, str(tiny_lora_dirs[name])))
    generator = torch.Generator().manual_seed(3)
    cache = [tuple(torch.randn(t.shape, generator=generator).to(DEVICE) for t in pair) for pair in runner.kv_caches]
    graphs = DecodeGraphs(loaded.model, [(k.clone(), v.clone()) for k, v in cache], [1, 4], 8,
                          loaded.arch.hidden_size, torch.float32, DEVICE, None, lora=runner.lora.batch)
    if DEVICE.type == "cuda":
        graphs.capture()
    contexts = [([1, 2], 20), ([3], 5)]
    for slots in ([0, 1], [-1, 0], [1, 1]):
        eager = _decode_hidden(runner, cache, slots)  # (on the CPU, the uncaptured graphs take its row groups)
        graphs.kv_caches[:] = [(k.clone(), v.clone()) for k, v in cache]
        step = graphs.run_step([5, 9], [19, 4], [2 * 16 + 3, 3 * 16 + 4], contexts, lora_slots=slots)
        assert graphs.lora_slots.tolist() == slots + [-1, -1]
        torch.testing.assert_close(step.hidden.float(), eager, atol=1e-4, rtol=1e-4)
    plain = _decode_hidden(runner, cache)
    assert not torch.allclose(plain, eager, atol=1e-3)  # the adapters changed the step
    graphs.kv_caches[:] = [(k.clone(), v.clone()) for k, v in cache]
    step = graphs.run_step([5, 9], [19, 4], [2 * 16 + 3, 3 * 16 + 4], contexts, lora_slots=[-1, -1])
    assert graphs.lora_slots.tolist() == [1, 1, -1, -1]  # the base graphs read no slots
    torch.testing.assert_close(step.hidden.float(), plain, atol=1e-4, rtol=1e-4)
    if DEVICE.type == "cuda":
        assert sorted(graphs.base_graphs) == sorted(graphs.graphs) == [1, 4]


def _verify_step_hidden(runner: ModelRunner, cache, graphs=None) -> torch.Tensor:
    """Final hidden states of a verify step (speculative decoding): one sequence's last token at position 19 and
    three drafts after it, and another sequence's decode, as decode rows (StepPlan.verify_rows)."""
    runner.kv_caches = [(k.clone(), v.clone()) for k, v in cache]
    blocks = [1, 2]
    positions = [19, 20, 21, 22]
    plan = StepPlan(input_ids=[5, 6, 7, 8, 9], positions=positions + [4],
                    slot_mapping=[blocks[p // 16] * 16 + p % 16 for p in positions] + [3 * 16 + 4],
                    decode_contexts=[(blocks, p + 1) for p in positions] + [([3], 5)], sample_rows=[0, 1, 2, 3, 4],
                    verify_rows=True)
    if graphs is None:
        return runner.forward(plan).float()
    graphs.kv_caches[:] = runner.kv_caches
    return graphs.run_step(plan.input_ids, plan.positions, plan.slot_mapping, plan.decode_contexts).hidden.float()


def test_verify_rows_of_one_sequence_attend_to_each_other_s_keys(tiny_model_dirs):
    """A drafted sequence's positions as decode rows of one step: each row attends to the keys the rows before it
    store in the same step. The Triton path (store every row's key and value, then attend) and the decode graphs
    captured for it equal the torch path."""
    from raylm.engine.cuda_graphs import DecodeGraphs
    from raylm.kernels.attention import build_metadata
    from raylm.kernels.triton_backend import build_triton_metadata

    runner, loaded = tiny_runner(tiny_model_dirs["llama"], torch.float32, DEVICE)
    generator = torch.Generator().manual_seed(4)
    cache = [tuple(torch.randn(t.shape, generator=generator).to(DEVICE) for t in pair) for pair in runner.kv_caches]
    runner.build_metadata = build_metadata
    torch_path = _verify_step_hidden(runner, cache)
    runner.build_metadata = build_triton_metadata
    torch.testing.assert_close(_verify_step_hidden(runner, cache), torch_path, atol=1e-4, rtol=1e-4)
    graphs = DecodeGraphs(loaded.model, runner.kv_caches, [8], 8, loaded.arch.hidden_size, torch.float32, DEVICE,
                          None, decode_write_first=True)
    if DEVICE.type == "cuda":
        graphs.capture()
    torch.testing.assert_close(_verify_step_hidden(runner, cache, graphs), torch_path, atol=1e-4, rtol=1e-4)


def test_a_prompt_as_rows_of_a_prefill_graph_gives_its_prefill_chunk(tiny_model_dirs):
    """A short prompt (after a cached prefix) as rows of their own in a write-first graph (the prefill graphs of
    cuda_graph_config.prefill_max_tokens; captured on CUDA) against the same tokens as a prefill chunk: the same
    hidden states and the same keys and values in the cache."""
    from raylm.engine.cuda_graphs import DecodeGraphs
    from raylm.kernels.triton_backend import build_triton_metadata

    runner, loaded = tiny_runner(tiny_model_dirs["llama"], torch.float32, DEVICE)
    runner.build_metadata = build_triton_metadata
    generator = torch.Generator().manual_seed(5)
    cache = [tuple(torch.randn(t.shape, generator=generator).to(DEVICE) for t in pair) for pair in runner.kv_caches]
    blocks, start, count = [2, 1, 3], 7, 21  # 7 cached positions, then 21 prompt tokens
    positions = list(range(start, start + count))
    tokens = torch.randint(0, loaded.arch.vocab_size, (count,), generator=generator).tolist()
    slots = [blocks[p // 16] * 16 + p % 16 for p in positions]
    runner.kv_caches = [(k.clone(), v.clone()) for k, v in cache]
    chunk = runner.forward(StepPlan(input_ids=tokens, positions=positions, slot_mapping=slots,
                                    prefill_chunks=[(blocks, start, count)], sample_rows=[count - 1])).float()
    chunk_cache = runner.kv_caches
    graphs = DecodeGraphs(loaded.model, [(k.clone(), v.clone()) for k, v in cache], [16, 32], 4,
                          loaded.arch.hidden_size, torch.float32, DEVICE, None, decode_write_first=True)
    if DEVICE.type == "cuda":
        graphs.capture()
        graphs.kv_caches[:] = [(k.copy_(k0), v.copy_(v0)) for (k, v), (k0, v0) in zip(graphs.kv_caches, cache)]
    step = graphs.run_step(tokens, positions, slots, [(blocks, p + 1) for p in positions])
    torch.testing.assert_close(step.hidden.float(), chunk, atol=1e-4, rtol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(graphs.kv_caches, chunk_cache):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
