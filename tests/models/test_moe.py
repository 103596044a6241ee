"""models/moe.py through LlamaForCausalLM.load_weights: a mixture-of-experts layer's experts arrive stacked, as
transformers holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I]), or one expert's projection at a time, as
checkpoints name them; either way a rank takes its experts (expert parallelism) and its slice of each expert's
intermediate dimension (tensor parallelism within an expert group). The ranks are built without a process group:
loading needs none."""

from __future__ import annotations

import pytest
import torch

from raylm.models.loader import load_hf_config
from raylm.models.parallel import ParallelContext
from raylm.models.registry import resolve_architecture
from raylm.models.source import resolve_model
from tests.conftest import hf_model, per_expert

MOE_LAYER = "model.layers.0.mlp.experts"  # the tiny Qwen3-MoE's layer 1 is dense (mlp_only_layers)


def _rank_model(path, ctx: ParallelContext):
    entry, arch = resolve_architecture(load_hf_config(resolve_model(str(path))))
    model = entry.model_class(arch, 128, ctx)
    for param in model.parameters():
        param.data.fill_(float("nan"))
    return model


def _stacked_experts(path) -> dict[str, torch.Tensor]:
    hf = hf_model(path)
    return {name: param.detach().clone() for name, param in hf.named_parameters() if name.startswith(MOE_LAYER)}


LAYOUTS = {  # (tp_rank, tp_size, ep_size): experts held, and the intermediate rows of each (of 32)
    "one rank": ((0, 1, 1), range(0, 8), slice(0, 32)),
    "rank 1 of 2, experts split": ((1, 2, 2), range(4, 8), slice(0, 32)),
    "rank 1 of 2, intermediate split": ((1, 2, 1), range(0, 8), slice(16, 32)),
    "rank 2 of 4, both split": ((2, 4, 2), range(4, 8), slice(0, 16)),
}


@pytest.mark.parametrize("form", ["stacked", "per-expert"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_takes_its_experts_and_their_intermediate_slice_from_either_name_form(tiny_model_dirs, form,
                                                                                     layout):
    (tp_rank, tp_size, ep_size), experts, rows = LAYOUTS[layout]
    path = tiny_model_dirs["qwen3_moe"]
    model = _rank_model(path, ParallelContext(tp_rank=tp_rank, tp_size=tp_size, ep_size=ep_size))
    stacked = _stacked_experts(path)
    named = list(stacked.items())
    loaded = model.load_weights(named if form == "stacked" else per_expert(named))
    assert loaded == {"layers.0.mlp.w13", "layers.0.mlp.w2"}
    block = model.layers[0].mlp
    gate_up, down = stacked[f"{MOE_LAYER}.gate_up_proj"], stacked[f"{MOE_LAYER}.down_proj"]
    for local, expert in enumerate(experts):
        gate, up = gate_up[expert].chunk(2)
        assert torch.equal(block.w13[local], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(block.w2[local], down[expert][:, rows])


def test_a_rank_skips_other_ranks_experts_and_takes_its_own_alone(tiny_model_dirs):
    path = tiny_model_dirs["qwen3_moe"]
    model = _rank_model(path, ParallelContext(tp_rank=1, tp_size=2, ep_size=2))  # experts 4..7
    named = per_expert(list(_stacked_experts(path).items()))
    assert model.load_weights([(n, t) for n, t in named if ".experts.2." in n]) == set()
    assert model.layers[0].mlp.w13.isnan().all()
    assert model.load_weights([(n, t) for n, t in named if ".experts.5.up_proj" in n]) == {"layers.0.mlp.w13"}
    w13 = model.layers[0].mlp.w13
    assert not w13[1, 32:].isnan().any()  # expert 5 is the second held; its up rows follow its 32 gate rows
    assert w13[1, :32].isnan().all() and w13[[0, 2, 3]].isnan().all()
