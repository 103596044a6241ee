"""models/weight_update.py: the names and full shapes an update is checked against, experts under both of their
names, and the check that refuses a wrong tensor before anything is copied."""

from __future__ import annotations

import re

import pytest
import torch

from raylm.models.loader import load_hf_config
from raylm.models.source import resolve_model
from raylm.models.weight_update import check_update, checkpoint_shapes

EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def moe_shapes(tiny_model_dirs) -> dict[str, tuple[int, ...]]:
    return checkpoint_shapes(load_hf_config(resolve_model(str(tiny_model_dirs["qwen3_moe"]))))


def test_experts_are_named_stacked_and_per_expert_and_other_weights_once(moe_shapes):
    assert moe_shapes[f"{EXPERTS}.gate_up_proj"] == (8, 64, 64)  # experts, 2 x intermediate, hidden
    assert moe_shapes[f"{EXPERTS}.down_proj"] == (8, 64, 32)
    for expert in range(8):
        assert moe_shapes[f"{EXPERTS}.{expert}.gate_proj.weight"] == (32, 64)
        assert moe_shapes[f"{EXPERTS}.{expert}.up_proj.weight"] == (32, 64)
        assert moe_shapes[f"{EXPERTS}.{expert}.down_proj.weight"] == (64, 32)
    assert f"{EXPERTS}.8.gate_proj.weight" not in moe_shapes
    assert moe_shapes["model.layers.1.mlp.gate_proj.weight"] == (128, 64)  # the dense layer, as it is
    assert not any(".layers.1.mlp.experts" in name for name in moe_shapes)
    assert moe_shapes["model.layers.0.mlp.gate.weight"] == (8, 64)  # the router


@pytest.mark.parametrize(("name", "shape", "expected"), [
    (f"{EXPERTS}.gate_up_proj", (8, 32, 64), [8, 64, 64]),  # gate rows only
    (f"{EXPERTS}.down_proj", (4, 64, 32), [8, 64, 32]),  # half the experts
    (f"{EXPERTS}.3.up_proj.weight", (64, 32), [32, 64]),  # transposed
])
def test_an_expert_tensor_of_the_wrong_shape_is_refused_by_name(moe_shapes, name, shape, expected):
    good = [(f"{EXPERTS}.0.gate_proj.weight", torch.zeros(32, 64)), (f"{EXPERTS}.down_proj", torch.zeros(8, 64, 32))]
    with pytest.raises(ValueError, match=re.escape(f"{name!r} has shape {list(shape)}, expected {expected}")):
        check_update([*good, (name, torch.zeros(shape))], moe_shapes, torch.float32, "Qwen3MoeForCausalLM")
    check_update(good, moe_shapes, torch.float32, "Qwen3MoeForCausalLM")
