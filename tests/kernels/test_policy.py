"""The kernel policy (kernels/policy.py): chosen from kernel_config, the device and the model's size, and handed
to the model's layers. The Triton GEMV and programmatic dependent launch by default for models whose decode steps
stream weights, cuBLAS and plain launches for the small ones; kernel_config overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from raylm.config import KernelConfig
from raylm.engine.model_runner import weight_bytes
from raylm.kernels import policy
from raylm.kernels.policy import KernelPolicy, choose_kernel_policy, set_kernel_policy
from raylm.models.parallel import SINGLE, ParallelContext
from raylm.models.registry import resolve_architecture

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
GPU = torch.device("cuda")
LARGE, SMALL = 16 << 30, 270 << 20


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 with Triton, as the policy sees it (no GPU is touched)."""
    monkeypatch.setattr(policy, "triton_available", lambda: True)
    monkeypatch.setattr(policy, "triton_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _meta_model(shape: str, tp: int):
    entry, arch = resolve_architecture(AutoConfig.from_pretrained(CONFIGS / shape))
    ctx = SINGLE if tp == 1 else ParallelContext(tp_rank=0, tp_size=tp)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return entry.model_class(arch, 4096, ctx)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("shape, tp, streams", [("llama-3.1-8b", 1, True), ("llama-3.1-8b", 2, True),
                                                ("smollm2-135m", 1, False)])
def test_weight_streaming_follows_the_weights_per_rank(shape, tp, streams):
    """Llama-3.1-8B (16 GB; 8 GB a rank at TP=2) streams weights, SmolLM2-135M (0.27 GB) does not; built on the
    meta device, so no weights are allocated."""
    assert policy.streams_weights(weight_bytes(_meta_model(shape, tp))) == streams


def test_defaults_follow_the_model_size(hopper):
    # PDL's tail trigger; LoRA's products beside the GEMV on a second stream
    assert choose_kernel_policy(GPU, LARGE) == KernelPolicy(triton=True, decode_gemv=True, pdl=4, lora_beside=True)
    assert choose_kernel_policy(GPU, SMALL) == KernelPolicy(triton=True, decode_gemv=False, pdl=0, lora_beside=True)


def test_kernel_config_overrides_the_defaults(hopper):
    assert choose_kernel_policy(GPU, LARGE, decode_gemv=False, pdl="off", lora_expand="kernel") == KernelPolicy(
        triton=True)
    assert choose_kernel_policy(GPU, SMALL, decode_gemv=True, pdl="exit", lora_expand="kernel") == KernelPolicy(
        True, True, 3)
    assert choose_kernel_policy(GPU, LARGE, triton=False) == KernelPolicy()  # the torch reference throughout
    for lora_expand, beside in (("kernel", False), ("beside", True)):
        assert choose_kernel_policy(GPU, LARGE, lora_expand=lora_expand).lora_beside == beside
    for fp8_attention, chosen_tiles in (("float16", (False, False, False)), ("float16_slices", (False, True, False)),
                                        ("float16_keys_first", (False, False, True)), ("fp8", (True, False, False))):
        chosen = choose_kernel_policy(GPU, LARGE, fp8_attention=fp8_attention)
        assert (chosen.fp8_attention_dot, chosen.fp8_attention_slices,
                chosen.fp8_attention_keys_first) == chosen_tiles
    assert choose_kernel_policy(GPU, LARGE, gemv_tiles="tune").gemv_tiles == "tune"


def test_pdl_needs_hopper_and_compiled_triton(hopper, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choose_kernel_policy(GPU, LARGE).pdl == 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(policy, "triton_interpreted", lambda: True)
    assert choose_kernel_policy(GPU, LARGE, pdl="start").pdl == 0


def test_fp8_rows_into_the_gemv_need_fp8_tensor_cores(hopper, monkeypatch):
    """fp8_gemv_input's FP8 modes (the default fp8_rows, and fp8) multiply FP8 by FP8: from compute capability 8.9
    (Ada, Hopper); an Ampere GPU's GEMV takes float16 instead, whatever was asked."""
    assert choose_kernel_policy(GPU, LARGE).fp8_gemv_input == "fp8_rows"
    asked = ("fp8_rows", "fp8", "fp8_tiles", "float16")
    for capability, modes in (((8, 9), list(asked)), ((8, 0), ["float16"] * 4)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert [choose_kernel_policy(GPU, LARGE, fp8_gemv_input=mode).fp8_gemv_input for mode in asked] == modes
    assert choose_kernel_policy(GPU, LARGE, fp8_gemv_input="model_dtype").fp8_gemv_input == "model_dtype"


def test_no_triton_kernel_runs_off_cuda_or_without_triton(monkeypatch):
    assert choose_kernel_policy(torch.device("cpu"), LARGE, decode_gemv=True, pdl="tail") == KernelPolicy()
    monkeypatch.setattr(policy, "triton_available", lambda: False)
    assert choose_kernel_policy(GPU, LARGE, decode_gemv=True) == KernelPolicy()


def test_kernel_config_rejects_unknown_pdl_modes():
    with pytest.raises(ValueError, match="pdl"):
        KernelConfig(pdl="sometimes")
    assert KernelConfig(pdl=False).pdl == "off"  # YAML's reading of a bare `off`


def test_the_policy_reaches_every_layer_that_chooses_kernels():
    model = _meta_model("smollm2-135m", 1)
    chosen = KernelPolicy(triton=True, decode_gemv=True, pdl=4)
    set_kernel_policy(model, chosen)
    choosers = [module for module in model.modules() if hasattr(module, "kernels")]
    assert {type(module).__name__ for module in choosers} >= {"RMSNorm", "QKVParallelLinear", "RowParallelLinear",
                                                               "MergedColumnParallelLinear", "Attention", "MLP",
                                                               "ParallelLMHead"}
    assert all(module.kernels is chosen for module in choosers)
    assert type(choosers[0]).kernels == KernelPolicy()  # other models keep the default



def test_gemv_prefetch_applies_under_pdl_and_takes_powers_of_two(hopper):
    """kernel_config.gemv_prefetch: bytes of each weight row a GEMV program asks the L2 for before its PDL wait, so
    nothing without PDL; 0 or a power of two from 128 to 16384."""
    from pydantic import ValidationError

    from raylm.config import KernelConfig

    assert choose_kernel_policy(GPU, LARGE, gemv_prefetch=4096).gemv_prefetch == 4096
    assert choose_kernel_policy(GPU, LARGE, pdl="off", gemv_prefetch=4096).gemv_prefetch == 0
    assert KernelConfig(gemv_prefetch=16384).gemv_prefetch == 16384
    for bad in (100, 3000, 32768, -128):
        with pytest.raises(ValidationError, match="gemv_prefetch"):
            KernelConfig(gemv_prefetch=bad)


def test_the_gemv_takes_fp8_rows_in_its_fp8_input_mode_only():
    """FP8 rows quantized before (Fp8Rows) go to the GEMV where its input mode is "fp8", "fp8_rows" or "fp8_tiles",
    the weight is FP8 and there are few rows; else to the FP8 matmul (kernels/linear.py)."""
    from types import SimpleNamespace

    from raylm.kernels.fp8 import FP8_DTYPE, Fp8Rows

    def rows(count: int) -> Fp8Rows:  # stands for FP8 values on a CUDA device
        return Fp8Rows(SimpleNamespace(is_cuda=True, shape=(count, 64)), None, torch.bfloat16)

    fp8_weight = torch.empty(32, 64, dtype=FP8_DTYPE)
    fp8_input = KernelPolicy(triton=True, decode_gemv=True, fp8_gemv_input="fp8")
    assert fp8_input.gemv_applies(rows(policy.GEMV_MAX_ROWS), fp8_weight)
    assert not fp8_input.gemv_applies(rows(policy.GEMV_MAX_ROWS + 1), fp8_weight)
    assert not fp8_input.gemv_applies(rows(1), torch.empty(32, 64, dtype=torch.bfloat16))
    float16_input = KernelPolicy(triton=True, decode_gemv=True, fp8_gemv_input="float16")
    assert not float16_input.gemv_applies(rows(1), fp8_weight)
    assert not KernelPolicy(triton=True, fp8_gemv_input="fp8").gemv_applies(rows(1), fp8_weight)  # no GEMV
    handed_only = KernelPolicy(triton=True, decode_gemv=True, fp8_gemv_input="fp8_rows")
    assert handed_only.gemv_applies(rows(1), fp8_weight)
    # fp8_rows: FP8 for the rows handed over, float16 for a tensor; a weight in the model's dtype takes that
    scale = torch.ones(32)
    assert [handed_only.gemv_input_mode(scale, x) for x in (rows(1), torch.ones(1, 64))] == ["fp8", "float16"]
    assert handed_only.gemv_input_mode(None, torch.ones(1, 64)) == "model_dtype"
    assert [fp8_input.gemv_input_mode(scale, x) for x in (rows(1), torch.ones(1, 64))] == ["fp8", "fp8"]
    assert [policy.gemv_takes_fp8_rows for policy in (fp8_input, handed_only, float16_input)] == [True, True, False]
    # fp8_tiles: FP8 for the rows handed over, quantized a tile at a time in the GEMV for a tensor
    tiles = KernelPolicy(triton=True, decode_gemv=True, fp8_gemv_input="fp8_tiles")
    assert tiles.gemv_applies(rows(1), fp8_weight) and tiles.gemv_takes_fp8_rows
    assert [tiles.gemv_input_mode(scale, x) for x in (rows(1), torch.ones(1, 64))] == ["fp8", "fp8_tiles"]
    assert tiles.gemv_input_mode(None, torch.ones(1, 64)) == "model_dtype"
