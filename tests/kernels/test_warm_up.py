"""The model runner's decode warm-up: it takes the Triton attention through its single-pass and split-K
variants without touching the KV cache, so that a running engine never stops to compile a kernel."""

from __future__ import annotations

import torch

from tests.kernels import MODULE_MARKS, kernel_device, tiny_runner

DEVICE = kernel_device()
pytestmark = MODULE_MARKS

from raylm.kernels import triton_attention  # noqa: E402
from raylm.kernels.triton_backend import build_triton_metadata  # noqa: E402


def test_decode_warm_up_runs_both_attention_variants_and_writes_nothing(tiny_model_dirs, monkeypatch):
    runner, _ = tiny_runner(tiny_model_dirs["llama"], torch.float32, DEVICE)
    # The CPU picks the torch path; the interpreter runs the Triton one.
    runner.attention_backend, runner.build_metadata = "triton", build_triton_metadata
    for k_cache, v_cache in runner.kv_caches:
        k_cache[1:].fill_(0.5)
        v_cache[1:].fill_(-0.5)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    splits = []
    decode = triton_attention._decode  # every decode attention launch, with or without the fused rotation

    def counting(*args, **kwargs):
        block_tables = args[3]
        splits.append(triton_attention.choose_num_splits(block_tables.shape[0], args[1].shape[2],
                                                         block_tables.shape[1] * args[1].shape[1], DEVICE))
        return decode(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "_decode", counting)
    runner.warm_up_decode(max_seq_len=512)

    assert splits and min(splits) == 1 and max(splits) > 1  # the single-pass and the split-K kernel
    for (k, v), (k_before, v_before) in zip(runner.kv_caches, before):
        assert torch.equal(k, k_before) and torch.equal(v, v_before)
