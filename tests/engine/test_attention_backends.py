"""Choosing the attention backend, and the FlashInfer backend's page description of a step (CPU)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from raylm.engine.model_runner import resolve_attention_backend
from raylm.kernels.flashinfer_backend import paged_kv_arrays


def test_auto_is_the_torch_reference_on_the_cpu():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backends_are_refused_where_they_cannot_run(backend):
    with pytest.raises(ValueError, match=f"attention_backend='{backend}' needs a CUDA device"):
        resolve_attention_backend(backend, torch.device("cpu"))


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="one of 'auto', 'torch', 'triton', 'flashinfer'"):
        resolve_attention_backend("sdpa", torch.device("cpu"))


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
    monkeypatch.setitem(sys.modules, "raylm.kernels.triton_attention", types.SimpleNamespace(
        write_kv_cache=lambda k, v, k_cache, v_cache, slots: writes.append(("write", slots.tolist())),
        rotary_write_kv_cache=lambda q, k, v, cos, sin, k_cache, v_cache, slots: writes.append(
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
