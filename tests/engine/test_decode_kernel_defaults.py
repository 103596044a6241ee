"""The decode kernels' default (kernels/dispatch.py): the Triton GEMV and programmatic dependent launch for models
whose decode steps stream weights, cuBLAS and plain launches for the small ones; RAYLM_TRITON_GEMV overrides it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from raylm.engine.model_runner import weight_bytes
from raylm.kernels import dispatch
from raylm.models.parallel import SINGLE, ParallelContext
from raylm.models.registry import resolve_architecture

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@pytest.fixture(autouse=True)
def default_settings(monkeypatch):
    """Each test reads the switch afresh with Triton taken as importable, and leaves the process default off."""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    dispatch.gemv_switch.cache_clear()
    yield
    dispatch.set_weight_streaming(False)
    dispatch.gemv_switch.cache_clear()


@pytest.mark.parametrize("shape, tp, streams", [("llama-3.1-8b", 1, True), ("llama-3.1-8b", 2, True),
                                                ("smollm2-135m", 1, False)])
def test_weight_streaming_follows_the_weights_per_rank(shape, tp, streams):
    """Llama-3.1-8B (16 GB; 8 GB a rank at TP=2) streams weights, SmolLM2-135M (0.27 GB) does not; built on the
    meta device, so no weights are allocated."""
    entry, arch = resolve_architecture(AutoConfig.from_pretrained(CONFIGS / shape))
    ctx = SINGLE if tp == 1 else ParallelContext(tp_rank=0, tp_size=tp)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = entry.model_class(arch, 4096, ctx)
    finally:
        torch.set_default_dtype(previous)
    assert dispatch.streams_weights(weight_bytes(model)) == streams


def test_the_gemv_follows_the_model_default_unless_the_switch_is_set(monkeypatch):
    monkeypatch.delenv("RAYLM_TRITON_GEMV", raising=False)
    assert not dispatch.triton_gemv_enabled()
    dispatch.set_weight_streaming(True)
    assert dispatch.triton_gemv_enabled()
    monkeypatch.setenv("RAYLM_TRITON_GEMV", "0")
    dispatch.gemv_switch.cache_clear()
    assert not dispatch.triton_gemv_enabled()
    dispatch.set_weight_streaming(False)
    monkeypatch.setenv("RAYLM_TRITON_GEMV", "1")
    dispatch.gemv_switch.cache_clear()
    assert dispatch.triton_gemv_enabled()


def test_the_gemv_never_runs_without_triton(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    monkeypatch.setenv("RAYLM_TRITON_GEMV", "1")
    dispatch.set_weight_streaming(True)
    assert not dispatch.triton_gemv_enabled()
