"""Choosing the attention backend, and the FlashInfer backend's page description of a step (CPU)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from raylm.engine.model_runner import resolve_attention_backend
from raylm.kernels.flashinfer_backend import paged_kv_arrays
from raylm.kernels.policy import KernelPolicy

REFERENCE = KernelPolicy()


def test_auto_is_the_torch_reference_without_triton_kernels():
    """On the CPU (or with kernel_config.triton off) the kernel policy runs no Triton kernel."""
    assert resolve_attention_backend("auto", REFERENCE) == "torch"
    assert resolve_attention_backend("torch", REFERENCE) == "torch"
    assert resolve_attention_backend("auto", KernelPolicy(triton=True)) == "triton"


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backends_are_refused_where_they_cannot_run(backend):
    with pytest.raises(ValueError, match=f"attention_backend='{backend}' needs a CUDA device"):
        resolve_attention_backend(backend, REFERENCE)


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="one of 'auto', 'torch', 'triton', 'flashinfer'"):
        resolve_attention_backend("sdpa", REFERENCE)


def test_llm_args_name_the_backends():
    from pydantic import ValidationError

    from raylm.config import LlmArgs

    assert LlmArgs(model="m", attention_backend="flashinfer").attention_backend == "flashinfer"
    with pytest.raises(ValidationError, match="attention_backend"):
        LlmArgs(model="m", attention_backend="sdpa")


def test_paged_kv_arrays_describe_each_context_by_its_blocks():
    # 1 token in one block; exactly two full blocks (a longer block list: only the first two hold context);
    # 33 tokens: two full blocks and one token in a third
    indptr, indices, last_page_len = paged_kv_arrays([([7], 1), ([3, 9, 4], 32), ([5, 6, 8], 33)], block_size=16)
    assert indptr.tolist() == [0, 1, 3, 6]
    assert indices.tolist() == [7, 3, 9, 5, 6, 8]
    assert last_page_len.tolist() == [1, 16, 1]
    assert {indptr.dtype, indices.dtype, last_page_len.dtype} == {np.dtype(np.int32)}


def test_paged_kv_arrays_refuse_a_context_longer_than_its_blocks():
    with pytest.raises(ValueError, match="a context of 33 tokens needs 3 blocks of 16, got 2"):
        paged_kv_arrays([([1, 2], 33)], block_size=16)


class _FakeWrapper:
    """Stands in for a FlashInfer wrapper: records its plans; run() marks each output row with `mark`."""

    mark = 0.0

    def __init__(self, workspace, layout, **options):
        self.layout, self.options, self.plans = layout, options, []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, cache):
        assert q.is_contiguous() and len(cache) == 2
        return torch.full_like(q, self.mark)


class _FakeDecode(_FakeWrapper):
    mark = 1.0


class _FakePrefill(_FakeWrapper):
    mark = 2.0


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """flashinfer and the Triton cache writes replaced by recorders, so the planner runs on the CPU."""
    import types

    writes = []
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_FakeDecode, BatchPrefillWithPagedKVCacheWrapper=_FakePrefill))
    monkeypatch.setitem(sys.modules, "raylm.kernels.triton_kv_cache", types.SimpleNamespace(
        write_kv_cache=lambda k, v, k_cache, v_cache, slots, pdl=0: writes.append(("write", slots.tolist())),
        rotary_write_kv_cache=lambda q, k, v, cos, sin, k_cache, v_cache, slots, pdl=0: writes.append(
            ("rotate", slots.tolist())) or q + 10))
    return writes


def _planner(**overrides):
    from raylm.kernels.flashinfer_backend import FlashInferPlanner

    options = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, dtype=torch.bfloat16,
                   device=torch.device("cpu"))
    return FlashInferPlanner(**{**options, **overrides})


def _plan(planner, decodes, prefills, window=None):
    slots = list(range(len(decodes) + sum(length for _, _, length in prefills)))
    return planner(decodes, prefills, slots, 16, window, torch.device("cpu"))


def test_flashinfer_plans_decodes_and_prefill_chunks_over_their_pages(fake_flashinfer):
    planner = _planner()
    meta = _plan(planner, decodes=[([3, 4], 20)], prefills=[([5, 6], 10, 7), ([9], 0, 3)])
    decode, prefill = planner.sets[0]
    assert decode.layout == prefill.layout == "NHD" and decode.options == {"use_tensor_cores": True}  # 4 q per kv
    (indptr, indices, last, *shape), options = decode.plans[0]
    assert (indptr.tolist(), indices.tolist(), last.tolist(), shape) == ([0, 2], [3, 4], [4], [8, 2, 64, 16])
    assert options == dict(window_left=-1, sm_scale=0.125, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    (qo_indptr, indptr, indices, last, *shape), options = prefill.plans[0]
    # a chunk of 7 queries after 10 cached tokens attends to 17 keys: pages 5 and 6, one key in the last
    assert (qo_indptr.tolist(), indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 7, 10], [0, 2, 3], [5, 6, 9],
                                                                                     [1, 3])
    assert shape == [8, 2, 64, 16] and options["causal"] is True
    assert (meta.num_decodes, meta.decode, meta.prefill) == (1, decode, prefill)


def test_flashinfer_rotates_plans_over_its_wrapper_sets(fake_flashinfer):
    planner = _planner(num_kv_heads=8)
    assert planner.sets[0][0].options == {"use_tensor_cores": False}
    metas = [_plan(planner, decodes=[([1], 5)], prefills=[]) for _ in range(4)]
    assert [meta.decode for meta in metas] == [planner.sets[i][0] for i in (0, 1, 2, 0)]
    assert all(meta.prefill is None for meta in metas)
    assert _plan(planner, [], [([2], 0, 4)], window=4096).prefill.plans[0][1]["window_left"] == 4095


def test_flashinfer_metadata_writes_the_cache_then_attends_each_part(fake_flashinfer):
    meta = _plan(_planner(), decodes=[([3], 2), ([4], 9)], prefills=[([5], 0, 3)])
    q = torch.zeros(5, 8, 64)
    out = meta.attend(q, q[:, :2], q[:, :2], None, None, 0.125)
    assert out[:2].eq(1.0).all() and out[2:].eq(2.0).all()
    rope = (torch.zeros(1), torch.zeros(1))
    meta.attend(q, q[:, :2], q[:, :2], None, None, 0.125, rope=rope)
    assert fake_flashinfer == [("write", [0, 1, 2, 3, 4]), ("rotate", [0, 1, 2, 3, 4])]
    with pytest.raises(ValueError, match="planned for softmax scale 0.125"):
        meta.attend(q, q[:, :2], q[:, :2], None, None, 0.5)


def test_flashinfer_takes_half_precision_only(fake_flashinfer):
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _planner(dtype=torch.float32)


def test_flashinfer_graph_wrappers_are_planned_per_batch_size_with_padding(fake_flashinfer):
    from raylm.kernels.flashinfer_backend import FlashInferDecodeGraphs

    planner = _planner()
    graphs = FlashInferDecodeGraphs(planner, [1, 4], max_blocks=8, block_size=16, sliding_window=None,
                                    device=torch.device("cpu"))
    wrapper = graphs.wrappers[4]
    assert wrapper.options["use_cuda_graph"] and wrapper.options["backend"] == "fa2"
    assert [len(wrapper.options[name]) for name in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                                    "paged_kv_last_page_len_buffer")] == [5, 32, 4]
    assert wrapper.options["paged_kv_indptr_buffer"].data_ptr() == graphs.wrappers[1].options[
        "paged_kv_indptr_buffer"].data_ptr()  # one set of page buffers for every size
    graphs.plan(4, [([3, 4], 20)])
    (indptr, indices, last, *shape), options = wrapper.plans[-1]
    # the real decode, then three padding rows on the null block's first key
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 3, 4, 5], [3, 4, 0, 0, 0], [4, 1, 1, 1])
    assert shape == [8, 2, 64, 16] and options == planner.options(None)
    slots = torch.tensor([7, -1, -1, -1])
    meta = graphs.metadata(4, slots)
    assert (meta.decode, meta.num_decodes, meta.prefill, meta.slot_mapping) == (wrapper, 4, None, slots)


def test_decode_graphs_plan_flashinfer_before_every_step(fake_flashinfer, tiny_model_dirs):
    """On the CPU the graphs run uncaptured over their buffers: each step plans the wrapper of its padded size
    and attends through it."""
    from raylm.engine.cuda_graphs import DecodeGraphs
    from raylm.kernels.flashinfer_backend import FlashInferDecodeGraphs
    from tests.kernels import tiny_runner

    runner, loaded = tiny_runner(tiny_model_dirs["llama"], torch.float32, torch.device("cpu"))
    attention = loaded.model.local_layers[0].self_attn
    planner = _planner(num_qo_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
                       head_dim=loaded.arch.head_dim, scale=attention.scale)
    flashinfer = FlashInferDecodeGraphs(planner, [1, 4], 8, 16, None, torch.device("cpu"))
    graphs = DecodeGraphs(loaded.model, runner.kv_caches, [1, 4], 8, loaded.arch.hidden_size, torch.float32,
                          torch.device("cpu"), None, flashinfer)
    for step in range(2):
        hidden = graphs.run_step([5, 9], [19, 4], [2 * 16 + 3, 3 * 16 + 4],
                                 [([1, 2], 20 + step), ([3], 5 + step)]).hidden
        assert hidden.shape == (2, loaded.arch.hidden_size)
        indptr, indices, last = flashinfer.wrappers[4].plans[-1][0][:3]
        assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 3, 4, 5], [1, 2, 3, 0, 0],
                                                                       [4 + step, 5 + step, 1, 1])
    assert len(flashinfer.wrappers[4].plans) == 2 and not flashinfer.wrappers[1].plans
    # every layer stored its keys at the step's slots, rotated, then attended through the wrapper
    assert fake_flashinfer[-1] == ("rotate", [2 * 16 + 3, 3 * 16 + 4, -1, -1])
