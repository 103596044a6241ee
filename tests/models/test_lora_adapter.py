"""Checking PEFT LoRA adapters against the model (models/lora_adapter.py): what is refused, and why."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from raylm.models.loader import load_hf_config
from raylm.models.lora_adapter import check_adapter, read_adapter
from raylm.models.registry import resolve_architecture
from raylm.models.source import resolve_model


def _arch(path):
    return resolve_architecture(load_hf_config(resolve_model(str(path))))[1]


@pytest.fixture(scope="module")
def arch(tiny_model_dirs):
    return _arch(tiny_model_dirs["llama"])


def _edited(source, target, config=None, tensors=None):
    """A copy of adapter `source` with config fields replaced and tensors changed by tensors(dict)."""
    shutil.copytree(source, target)
    if config is not None:
        path = target / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        weights = load_file(str(target / "adapter_model.safetensors"))
        tensors(weights)
        save_file(weights, str(target / "adapter_model.safetensors"))
    return target


def test_a_peft_adapter_reads_with_its_rank_scaling_and_modules(tiny_lora_dirs, arch):
    spec = check_adapter(tiny_lora_dirs["r8"], arch, 64)
    assert (spec.rank, spec.scaling) == (8, 2.0)
    assert len(spec.modules) == 2 * 7
    assert check_adapter(tiny_lora_dirs["r64"], arch, 64).scaling == pytest.approx(32 / 8)  # rslora: alpha / sqrt(r)
    assert {module for _, module in check_adapter(tiny_lora_dirs["qv"], arch, 64).modules} == {"q_proj", "v_proj"}


def test_read_adapter_folds_the_scaling_into_b(tiny_lora_dirs, arch):
    _, matrices = read_adapter(tiny_lora_dirs["r8"], arch, 64, torch.float32)
    raw = load_file(str(tiny_lora_dirs["r8"] / "adapter_model.safetensors"))
    a, b = matrices[(1, "down_proj")]
    assert torch.equal(a, raw["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])
    torch.testing.assert_close(b, raw["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"] * 2.0)


def _drop_first_b(weights):
    del weights[next(name for name in weights if "lora_B" in name)]


def _add_lm_head(weights):
    weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)


def _widen_q(weights):
    weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 65)


@pytest.mark.parametrize(("config", "tensors", "message"), [
    ({"target_modules": ["q_proj", "lm_head"]}, None, r"target_modules \['lm_head'\] are not supported"),
    ({"bias": "lora_only"}, None, "bias must be 'none'"),
    ({"lora_bias": True}, None, "LoRA biases"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"use_dora": True}, None, "DoRA"),
    ({"rank_pattern": {"q_proj": 4}}, None, "rank_pattern"),
    ({"peft_type": "IA3"}, None, "peft_type must be 'LORA'"),
    ({"r": 0}, None, "r must be a positive integer"),
    ({"target_modules": ".*"}, _add_lm_head, "lm_head.lora_A.weight' is not a LoRA matrix of a supported module"),
    (None, _drop_first_b, "has lora_A or lora_B but not both"),
    (None, _widen_q, r"has shape \(8, 65\), expected \(8, 64\)"),
])
def test_unsupported_adapters_are_refused_saying_what_is_wrong(tiny_lora_dirs, arch, tmp_path, config, tensors,
                                                                message):
    path = _edited(tiny_lora_dirs["r8"], tmp_path / "bad", config, tensors)
    with pytest.raises(ValueError, match=message):
        check_adapter(path, arch, 64)


def test_rank_above_max_lora_rank_and_missing_files_are_refused(tiny_lora_dirs, arch, tmp_path):
    with pytest.raises(ValueError, match=r"r=64 exceeds lora_config.max_lora_rank \(32\)"):
        check_adapter(tiny_lora_dirs["r64"], arch, 32)
    with pytest.raises(ValueError, match="is not a directory"):
        check_adapter(tmp_path / "nowhere", arch, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        check_adapter(tmp_path / "empty", arch, 64)
    no_weights = _edited(tiny_lora_dirs["r8"], tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        check_adapter(no_weights, arch, 64)


def test_an_adapter_of_another_model_shape_is_refused(tiny_model_dirs, tiny_lora_dirs):
    other = _arch(tiny_model_dirs["llama_6heads"])
    with pytest.raises(ValueError, match="expected"):
        check_adapter(tiny_lora_dirs["r8"], other, 64)


def test_adapters_of_mixture_of_experts_mlps_are_refused(tiny_model_dirs, tiny_lora_dirs, tmp_path):
    moe = _arch(tiny_model_dirs["qwen3_moe"])
    assert moe.is_moe_layer(0)
    with pytest.raises(ValueError, match="mixture-of-experts MLP of layer 0"):
        check_adapter(tiny_lora_dirs["r8"], moe, 64)
