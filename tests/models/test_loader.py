"""Finding and loading models: GGUF conversion, HF directories, dummy weights, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from raylm import LLM, KvCacheConfig, SamplingParams
from raylm.models.loader import load_hf_config, load_model
from raylm.models.parallel import SINGLE, ParallelContext
from raylm.models.registry import supported_architectures
from raylm.models.source import default_model_path, resolve_model


def test_gguf_conversion_equals_hf_transformers_gguf_loading(smollm2_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    expected = reference.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    missing = {name for name in expected if name not in ours} - {"lm_head.weight"}
    assert not missing


def test_default_model_alias_and_no_model_resolve_to_the_embedded_smollm2():
    assert resolve_model(None).name == "smollm2-135m-instruct"
    assert resolve_model("SmolLM2-135M-Instruct").config_dir == resolve_model(None).config_dir


def test_default_model_greedy_continuation_is_paris():
    with LLM(kv_cache_config=KvCacheConfig(max_tokens=1024)) as llm:
        output = llm.generate("The capital of France is", SamplingParams(max_tokens=4))
    assert output.outputs[0].text.startswith(" Paris.")


def test_gguf_file_path_loads_directly():
    with LLM(str(default_model_path()), kv_cache_config=KvCacheConfig(max_tokens=1024)) as llm:
        output = llm.generate("The capital of France is", SamplingParams(max_tokens=2))
    assert output.outputs[0].text == " Paris."


def test_unknown_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not an existing directory"):
        LLM(str(tmp_path / "nope" / "missing-model.bin"))


def test_hub_id_offline_error_names_the_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"no-such-org/no-such-model.*HF_HUB_OFFLINE"):
        resolve_model("no-such-org/no-such-model")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, tiny_model_dirs):
    config = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported; supported: " + ", ".join(supported_architectures())):
        load_model(resolve_model(str(tmp_path)), load_hf_config(resolve_model(str(tmp_path))), torch.float32,
                   torch.device("cpu"), 128, load_format="dummy")


def test_dummy_weights_have_the_right_shapes_and_run(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["qwen2"]), load_format="dummy", kv_cache_config=KvCacheConfig(max_tokens=512)) as llm:
        output = llm.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 5



def test_dummy_experts_are_one_model_whatever_rank_holds_them(tiny_model_dirs):
    """Dummy weights come through the checkpoint path, stacked experts included: a rank holding experts 4..7 of 8
    has the very experts that a single rank has."""
    source = resolve_model(str(tiny_model_dirs["qwen3_moe"]))

    def experts(ctx: ParallelContext):
        loaded = load_model(source, load_hf_config(source), torch.float32, torch.device("cpu"), 128, "dummy", ctx)
        return loaded.model.layers[0].mlp

    whole, second_half = experts(SINGLE), experts(ParallelContext(tp_rank=1, tp_size=2, ep_size=2))
    assert torch.equal(second_half.w13, whole.w13[4:]) and torch.equal(second_half.w2, whole.w2[4:])

def test_sharded_safetensors_directory_loads(tmp_path, tiny_model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    params = SamplingParams(max_tokens=8)
    with LLM(str(tmp_path), kv_cache_config=KvCacheConfig(max_tokens=512)) as sharded:
        got = sharded.generate([5, 6, 7, 8], params).outputs[0].token_ids
    with LLM(str(source), kv_cache_config=KvCacheConfig(max_tokens=512)) as whole:
        assert got == whole.generate([5, 6, 7, 8], params).outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_load_and_generate(dtype, tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), dtype=dtype, kv_cache_config=KvCacheConfig(max_tokens=512)) as llm:
        assert llm.info.dtype == dtype
        output = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 4
