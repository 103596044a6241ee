"""models/quantization.py and the FP8 model: quant_config checked at the edge, weights quantized as they load or
loaded from FP8 checkpoints (transformers' "fp8", compressed-tensors) to the same values, split across
tensor-parallel ranks like the weights in the model's dtype, refreshed by update_weights, and generating what a
float model of the dequantized weights generates."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from raylm import LLM, KvCacheConfig, LlmArgs, QuantConfig, SamplingParams, TokensPrompt
from raylm.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
from raylm.kernels.linear import linear
from raylm.models import moe
from raylm.models.loader import load_hf_config, load_model
from raylm.models.parallel import SINGLE, ColumnParallelLinear, ParallelContext, RowParallelLinear
from raylm.models.quantization import Fp8Weights, resolve_fp8_weights
from raylm.models.source import resolve_model
from raylm.models.weight_update import apply_update, check_update, checkpoint_shapes
from tests.conftest import hf_model, per_expert, perturbed_hf_model

FP8 = QuantConfig(quant_algo="FP8")
KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16)
PROMPTS = [[(i * 7919 + j * 104729) % 49000 + 10 for j in range(24)] for i in range(3)]


# ------------------------------------------------------------------ checkpoints written by the tests


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A tiny model's tensors, its experts one tensor per expert and projection (as FP8 checkpoints name them)."""
    return dict(per_expert(list(load_file(str(path / "model.safetensors")).items())))


def _is_decoder_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _write(target: Path, source: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "generation_config.json", target)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(target / "model.safetensors"))
    return target


COMPRESSED_TENSORS = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                      "quantization_status": "compressed", "kv_cache_scheme": None}


def _compressed_tensors_config(strategy: str) -> dict:
    group = {"targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "dynamic": True, "symmetric": True},
             "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}}
    return {**COMPRESSED_TENSORS, "config_groups": {"group_0": group}}


FORMATS = {  # name: (quantization_config, per_tensor, scale tensor's name, its shape as the format writes it)
    "fp8 per tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, True,
                       "weight_scale_inv", lambda scale: scale[0].reshape(())),
    "fp8 per row": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [1, 4096]}, False,
                    "weight_scale_inv", lambda scale: scale.unsqueeze(1)),
    "compressed-tensors per channel": (_compressed_tensors_config("channel"), False, "weight_scale",
                                       lambda scale: scale.unsqueeze(1)),
    "compressed-tensors per tensor": (_compressed_tensors_config("tensor"), True, "weight_scale",
                                      lambda scale: scale[:1]),
}


def _fp8_checkpoint(target: Path, source: Path, form: str) -> Path:
    """The tiny model at `source` quantized as `form` writes it: FP8 weights with their scales (and, for
    compressed-tensors, static input scales, which raylm does not use)."""
    quantization_config, per_tensor, scale_name, scale_shape = FORMATS[form]
    tensors = {}
    for name, tensor in _checkpoint(source).items():
        if not _is_decoder_linear(name):
            tensors[name] = tensor
            continue
        quantized, scale = quantize_fp8(tensor, per_tensor=per_tensor)
        prefix = name.removesuffix(".weight")
        tensors[name], tensors[f"{prefix}.{scale_name}"] = quantized, scale_shape(scale)
        if quantization_config["quant_method"] == "compressed-tensors":
            tensors[f"{prefix}.input_scale"] = torch.ones(1)
    return _write(target, source, tensors, quantization_config)


def _load(path: Path, fp8: Fp8Weights | None, ctx: ParallelContext = SINGLE):
    source = resolve_model(str(path))
    return load_model(source, load_hf_config(source), torch.float32, torch.device("cpu"), 128, ctx=ctx,
                      fp8=fp8).model


def _state(model) -> dict[str, torch.Tensor]:
    """Parameters by name, FP8 ones as their bytes (compared exactly)."""
    return {name: param.detach().view(torch.uint8) if param.dtype == FP8_DTYPE else param.detach()
            for name, param in model.named_parameters()}


def _assert_same_state(got, expected) -> None:
    got, expected = _state(got), _state(expected)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


# ------------------------------------------------------------------ configuration


def test_quant_config_is_exported_and_refuses_what_it_does_not_know_by_name():
    assert LlmArgs(quant_config={"quant_algo": "FP8"}).quant_config == FP8
    assert LlmArgs().quant_config.quant_algo is None
    with pytest.raises(ValidationError, match=r"quant_config\.quant_algo\n.*'FP8'"):
        LlmArgs(quant_config={"quant_algo": "W4A16"})
    with pytest.raises(ValidationError, match=r"quant_config\.weight_scale\n.*'per_channel' or 'per_tensor'"):
        LlmArgs(quant_config={"quant_algo": "FP8", "weight_scale": "per_block"})
    with pytest.raises(ValidationError, match=r"quant_config\.group_size\n.*Extra inputs"):
        LlmArgs(quant_config={"quant_algo": "FP8", "group_size": 128})


def test_quant_config_is_in_the_serve_schema():
    from raylm.serving.config import serve_args_schema

    schema = serve_args_schema()
    assert schema["properties"]["quant_config"]["$ref"].endswith("/QuantConfig")
    assert set(schema["$defs"]["QuantConfig"]["properties"]) == {"quant_algo", "kv_cache_quant_algo", "weight_scale"}


class HfConfig:
    def __init__(self, quantization_config: dict | None = None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


@pytest.mark.parametrize(("form", "per_tensor"), [("fp8 per tensor", True), ("compressed-tensors per channel", False)])
def test_an_fp8_checkpoint_implies_fp8_weights_scaled_as_it_is(form, per_tensor):
    config = HfConfig(FORMATS[form][0])
    method = FORMATS[form][0]["quant_method"]
    assert resolve_fp8_weights(QuantConfig(), config) == Fp8Weights(per_tensor, method)
    assert resolve_fp8_weights(FP8, config) == Fp8Weights(per_tensor, method)
    assert resolve_fp8_weights(FP8, HfConfig()) == Fp8Weights()
    assert resolve_fp8_weights(QuantConfig(quant_algo="FP8", weight_scale="per_tensor"), HfConfig()).per_tensor
    assert resolve_fp8_weights(QuantConfig(), HfConfig()) is None


@pytest.mark.parametrize(("quantization_config", "quant_config", "message"), [
    ({"quant_method": "awq", "bits": 4}, FP8, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, QuantConfig(), r"weight_block_size \[128, 128\]"),
    ({"quant_method": "fp8", "weight_block_size": None, "scale_fmt": "ue8m0"}, QuantConfig(), "scale_fmt 'ue8m0'"),
    (_compressed_tensors_config("channel"), QuantConfig(quant_algo="FP8", weight_scale="per_tensor"),
     "quant_config.weight_scale is 'per_tensor' but the checkpoint's FP8 weights are scaled per_channel"),
    ({**_compressed_tensors_config("channel"), "kv_cache_scheme": {"num_bits": 8, "type": "int"}}, QuantConfig(),
     "kv_cache_scheme quantizes the KV cache to int 8 bits; supported: float 8 bits"),
    ({**_compressed_tensors_config("group"), "format": "float-quantized"}, QuantConfig(), "strategy 'group'"),
    ({**COMPRESSED_TENSORS, "format": "pack-quantized"}, QuantConfig(), "format 'pack-quantized'"),
])
def test_a_quantization_raylm_does_not_load_is_a_value_error_naming_the_field(quantization_config, quant_config,
                                                                               message):
    with pytest.raises(ValueError, match=message):
        resolve_fp8_weights(quant_config, HfConfig(quantization_config))


def test_fp8_is_refused_for_an_encoder_model(minilm_dir):
    source = resolve_model(str(minilm_dir))
    with pytest.raises(ValueError, match="quant_config.quant_algo='FP8' is for decoder models, not BertModel"):
        load_model(source, load_hf_config(source), torch.float32, torch.device("cpu"), 128, load_format="dummy",
                   fp8=Fp8Weights())


# ------------------------------------------------------------------ what the model holds


def test_decoder_linears_are_fp8_with_per_row_scales_and_the_rest_keeps_its_dtype(tiny_model_dirs):
    path = tiny_model_dirs["qwen3_moe"]
    model = _load(path, Fp8Weights())
    fp8 = {name for name, param in model.named_parameters() if param.dtype == FP8_DTYPE}
    attention = {f"layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in ("qkv", "o")}
    mlps = {"layers.0.mlp.w13", "layers.0.mlp.w2", "layers.1.mlp.gate_up_proj.weight", "layers.1.mlp.down_proj.weight"}
    assert fp8 == attention | mlps
    params = dict(model.named_parameters())
    for name in fp8:
        scale = params[name.removesuffix(".weight") + ".weight_scale" if name.endswith(".weight") else name + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == params[name].shape[:-1]
    assert params["embed_tokens.weight"].dtype == params["lm_head.weight"].dtype == torch.float32
    assert params["layers.0.mlp.gate.weight"].dtype == torch.float32  # the router
    checkpoint = _checkpoint(path)
    qkv = [checkpoint[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    quantized = [quantize_fp8(w) for w in qkv]  # each part by its own rows
    assert torch.equal(params["layers.1.self_attn.qkv_proj.weight"].view(torch.uint8),
                       torch.cat([q for q, _ in quantized]).view(torch.uint8))
    assert torch.equal(params["layers.1.self_attn.qkv_proj.weight_scale"], torch.cat([s for _, s in quantized]))


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tensor_parallel_ranks_hold_the_single_ranks_rows_with_their_scales(tiny_model_dirs, arch, per_tensor):
    """Column-parallel shards (qkv, gate_up, experts' w13) take their rows' scales; row-parallel ones (o, down,
    experts' w2) split columns and keep every row's scale, quantized from whole rows."""
    path = tiny_model_dirs[arch]
    whole = _state(_load(path, Fp8Weights(per_tensor)))
    for rank in (0, 1):
        shard = _state(_load(path, Fp8Weights(per_tensor), ParallelContext(tp_rank=rank, tp_size=2)))
        qkv, head_dim = "layers.0.self_attn.qkv_proj", 16 if arch == "llama" else 32
        full_q, full_kv = 4 * head_dim, 2 * head_dim  # 4 heads, 2 KV heads: each rank takes half of each
        q_rows, kv_rows = full_q // 2, full_kv // 2
        rows = torch.cat([torch.arange(rank * q_rows, (rank + 1) * q_rows),
                          full_q + torch.arange(rank * kv_rows, (rank + 1) * kv_rows),
                          full_q + full_kv + torch.arange(rank * kv_rows, (rank + 1) * kv_rows)])
        for suffix in ("weight", "weight_scale"):
            assert torch.equal(shard[f"{qkv}.{suffix}"], whole[f"{qkv}.{suffix}"][rows])
        o_proj = "layers.0.self_attn.o_proj"
        assert torch.equal(shard[f"{o_proj}.weight"], whole[f"{o_proj}.weight"][:, rank * q_rows:(rank + 1) * q_rows])
        assert torch.equal(shard[f"{o_proj}.weight_scale"], whole[f"{o_proj}.weight_scale"])
        mlp = "layers.1.mlp" if arch == "qwen3_moe" else "layers.0.mlp"  # a dense MLP, intermediate size 128
        half = torch.arange(rank * 64, (rank + 1) * 64)
        for suffix in ("weight", "weight_scale"):
            gate_up = f"{mlp}.gate_up_proj.{suffix}"
            assert torch.equal(shard[gate_up], whole[gate_up][torch.cat([half, 128 + half])])
        down = f"{mlp}.down_proj"
        assert torch.equal(shard[f"{down}.weight"], whole[f"{down}.weight"][:, rank * 64:(rank + 1) * 64])
        assert torch.equal(shard[f"{down}.weight_scale"], whole[f"{down}.weight_scale"])
        if arch == "qwen3_moe":
            inter = torch.arange(rank * 16, (rank + 1) * 16)
            w13_rows = torch.cat([inter, 32 + inter])
            assert torch.equal(shard["layers.0.mlp.w13"], whole["layers.0.mlp.w13"][:, w13_rows])
            assert torch.equal(shard["layers.0.mlp.w13_scale"], whole["layers.0.mlp.w13_scale"][:, w13_rows])
            assert torch.equal(shard["layers.0.mlp.w2"], whole["layers.0.mlp.w2"][:, :, rank * 16:(rank + 1) * 16])
            assert torch.equal(shard["layers.0.mlp.w2_scale"], whole["layers.0.mlp.w2_scale"])


@pytest.mark.parametrize("per_tensor", [False, True])
def test_stacked_and_per_expert_checkpoints_quantize_to_the_same_experts(tiny_model_dirs, per_tensor):
    """The checkpoint on disk names each expert's projections; transformers' model (a trainer's) stacks them."""
    path = tiny_model_dirs["qwen3_moe"]
    model = _load(path, Fp8Weights(per_tensor))
    stacked = [(name, param.detach()) for name, param in hf_model(path).named_parameters() if ".mlp.experts." in name]
    assert {name.rsplit(".", 1)[-1] for name, _ in stacked} == {"gate_up_proj", "down_proj"}
    block = model.layers[0].mlp
    per_expert_state = _state(block)
    assert model.load_weights(stacked) == {f"layers.0.mlp.{p}" for p in ("w13", "w13_scale", "w2", "w2_scale")}
    state = _state(block)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(state[name], per_expert_state[name]), name


# ------------------------------------------------------------------ FP8 checkpoints


@pytest.mark.parametrize("form", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_an_fp8_checkpoint_loads_its_weights_and_scales_as_quantizing_on_load_makes_them(tmp_path, tiny_model_dirs,
                                                                                       arch, form):
    source = tiny_model_dirs[arch]
    path = _fp8_checkpoint(tmp_path / "fp8", source, form)
    fp8 = resolve_fp8_weights(QuantConfig(), load_hf_config(resolve_model(str(path))))
    assert fp8 == Fp8Weights(FORMATS[form][1], FORMATS[form][0]["quant_method"])
    _assert_same_state(_load(path, fp8), _load(source, Fp8Weights(per_tensor=fp8.per_tensor)))
    _assert_same_state(_load(path, fp8, ParallelContext(tp_rank=1, tp_size=2)),
                       _load(source, Fp8Weights(per_tensor=fp8.per_tensor), ParallelContext(tp_rank=1, tp_size=2)))


def test_an_fp8_checkpoint_is_detected_by_llm_and_generates_as_quantizing_on_load(tmp_path, tiny_model_dirs):
    source = tiny_model_dirs["llama"]
    path = _fp8_checkpoint(tmp_path / "fp8", source, "compressed-tensors per channel")
    assert _generate(path) == _generate(source, quant_config=FP8)
    with pytest.raises(ValueError, match="quant_config.weight_scale"):
        LLM(str(path), quant_config=QuantConfig(quant_algo="FP8", weight_scale="per_tensor"), skip_tokenizer_init=True)


def test_a_checkpoint_made_for_an_fp8_kv_cache_turns_it_on_with_its_static_kv_scales(tmp_path, tiny_model_dirs):
    """kv_cache_scheme FP8 turns the FP8 cache on; its k_scale / v_scale are the cache's per-tensor scales under
    fp8_scales='auto' (the default), and per_token ignores them."""
    source = tiny_model_dirs["llama"]
    plain = _fp8_checkpoint(tmp_path / "fp8", source, "compressed-tensors per channel")
    config = json.loads((plain / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(plain / "model.safetensors"))
    for layer in range(2):
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(3.0)
    path = _write(tmp_path / "fp8-kv", source, tensors,
                  {**config, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                 "dynamic": False, "symmetric": True}})
    assert resolve_fp8_weights(QuantConfig(), load_hf_config(resolve_model(str(path)))).kv_cache
    fp8_cache = KvCacheConfig(max_tokens=2048, tokens_per_block=16, dtype="fp8")
    with_kv = _generate(path)
    assert with_kv == _generate(path, kv_cache_config=fp8_cache.model_copy(update={"fp8_scales": "per_tensor"}))
    per_token = _generate(path, kv_cache_config=fp8_cache.model_copy(update={"fp8_scales": "per_token"}))
    assert with_kv != per_token and per_token == _generate(plain, kv_cache_config=fp8_cache)
    assert with_kv != _generate(plain)
    float_cache = KvCacheConfig(max_tokens=2048, tokens_per_block=16, dtype="float32")
    assert _generate(path, kv_cache_config=float_cache) == _generate(plain)  # a dtype set says otherwise


def test_an_fp8_tensor_where_the_model_keeps_its_dtype_is_refused_by_name(tmp_path, tiny_model_dirs):
    source = tiny_model_dirs["llama"]
    path = _fp8_checkpoint(tmp_path / "fp8", source, "fp8 per tensor")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(FP8_DTYPE)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="'lm_head.weight' is in FP8, but lm_head.weight is not"):
        _load(path, Fp8Weights(True, "fp8"))


# ------------------------------------------------------------------ generation


def _generate(path: Path, **kwargs) -> list:
    """Greedy tokens and the prompt's logprobs (teacher-forced) of PROMPTS."""
    params = SamplingParams(max_tokens=6, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    with LLM(str(path), skip_tokenizer_init=True, **{"kv_cache_config": KV, **kwargs}) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [(out.outputs[0].token_ids, [position[token].logprob for position, token in
                                         zip(out.prompt_logprobs[1:], prompt[1:])])
            for out, prompt in zip(outputs, PROMPTS)]


def _fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x quantized to FP8 per token and back, as the FP8 linear layers take their input."""
    return dequantize_fp8(*quantize_fp8(x.reshape(-1, x.shape[-1]))).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_the_fp8_model_equals_a_float_model_of_its_dequantized_weights_exactly(tmp_path, tiny_model_dirs, arch,
                                                                             monkeypatch):
    """A float32 model whose checkpoint holds the dequantized FP8 weights, its linear layers fed activations
    quantized per token as the FP8 ones are: the same tokens and the same logprobs, bit for bit."""
    source = tiny_model_dirs[arch]
    fp8 = _generate(source, quant_config=FP8)
    dequantized = {name: dequantize_fp8(*quantize_fp8(tensor)) if _is_decoder_linear(name) else tensor
                   for name, tensor in _checkpoint(source).items()}
    path = _write(tmp_path / "dequantized", source, dequantized, None)
    column_forward, row_forward, expert_linear = ColumnParallelLinear.forward, RowParallelLinear.forward, moe.linear
    monkeypatch.setattr(ColumnParallelLinear, "forward", lambda self, x: column_forward(self, _fake_quantized(x)))
    monkeypatch.setattr(RowParallelLinear, "forward",
                        lambda self, x, defer_reduce=False: row_forward(self, _fake_quantized(x), defer_reduce))
    monkeypatch.setattr(moe, "linear", lambda x, *args: expert_linear(_fake_quantized(x), *args))
    assert _generate(path) == fp8


LOGPROB_GAP_BOUND = 0.15  # mean |FP8 - float32| of the prompt's logprobs; measured 0.065-0.078 on the tiny models


@pytest.mark.parametrize("weight_scale", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_fp8_logprobs_stay_within_fp8_precision_of_the_float_model(tiny_model_dirs, arch, weight_scale):
    path = tiny_model_dirs[arch]
    fp8 = _generate(path, quant_config=QuantConfig(quant_algo="FP8", weight_scale=weight_scale))
    reference = _generate(path)
    gaps = torch.tensor([abs(a - b) for (_, ours), (_, theirs) in zip(fp8, reference) for a, b in zip(ours, theirs)])
    assert gaps.mean() < LOGPROB_GAP_BOUND and gaps.max() < 1.0
    assert (gaps > 0).any()  # the weights were quantized


def test_fp8_smollm2_still_answers_paris():
    """The real model (random tiny models' next tokens are near ties, so their greedy tokens say little)."""
    params = SamplingParams(max_tokens=3)
    with LLM(quant_config=FP8, kv_cache_config=KvCacheConfig(max_tokens=512)) as llm:
        assert llm.generate("The capital of France is", params).outputs[0].text.startswith(" Paris.")


def _mean_gap(ours: list, theirs: list) -> torch.Tensor:
    """Mean |difference| of two _generate results' prompt logprobs."""
    return torch.tensor([abs(a - b) for (_, one), (_, other) in zip(ours, theirs) for a, b in zip(one, other)]).mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fp8_on_gpu_through_scaled_mm_matches_the_reference_path(tiny_model_dirs, arch, monkeypatch):
    """bfloat16 on the GPU: torch._scaled_mm against the float32 reference run in bfloat16, the same FP8 operands in
    both. Hopper's FP8 products sum in their own order and precision, and a random tiny model carries any change of
    rounding through every layer: the bound is what bfloat16 itself costs, the reference path in float32 against
    the same in bfloat16 (their gap measured 0.02-0.03; a wrong scale or layout is off by far more)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9+ (FP8 matmuls)")
    from raylm.kernels import fp8 as fp8_kernels

    path = tiny_model_dirs[arch]
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kw: calls.append(1) or scaled_mm(*args, **kw))
    options = dict(quant_config=FP8, device="cuda", executor="local")
    fast = _generate(path, dtype="bfloat16", **options)
    assert calls  # the FP8 matmul ran
    monkeypatch.setattr(fp8_kernels, "scaled_mm_applies", lambda x, weight: False)
    reference = _generate(path, dtype="bfloat16", **options)
    precise = _generate(path, dtype="float32", **options)
    assert _mean_gap(fast, reference) < 2 * _mean_gap(reference, precise)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_rows_from_the_norms_and_silu_mul_give_what_the_layers_own_quantization_gives(monkeypatch):
    """Where the qkv, gate / up and down projections multiply in FP8 (torch._scaled_mm: prefill rows), the RMSNorms
    and the SiLU-and-mul before them write their rows in FP8 (triton_ops.rms_norm_fp8, silu_and_mul_fp8): the same
    bytes as the layers' own quantization, so the same logprobs, bit for bit. SmolLM2-135M's shape with random
    weights (its sizes fit _scaled_mm)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9+ (FP8 matmuls)")
    from raylm.kernels import triton_ops

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "smollm2-135m"
    calls = []
    for name in ("rms_norm_fp8", "silu_and_mul_fp8"):
        kernel = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *args, _name=name, _kernel=kernel, **kw:
                            calls.append(_name) or _kernel(*args, **kw))
    options = dict(quant_config=FP8, device="cuda", executor="local", dtype="bfloat16", load_format="dummy")
    fused = _generate(path, **options)
    # Both norms and the SiLU-and-mul of every layer (30), at least in the prefill step.
    assert calls.count("rms_norm_fp8") >= 2 * 30 and calls.count("silu_and_mul_fp8") >= 30
    monkeypatch.setattr(ColumnParallelLinear, "takes_fp8_rows", lambda self, x: False)
    monkeypatch.setattr(RowParallelLinear, "takes_fp8_rows", lambda self, x: False)
    assert _generate(path, **options) == fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8_gemv_input", ["model_dtype", "float16", "fp8", "fp8_rows", "fp8_tiles"])
def test_fp8_decode_steps_run_the_gemv_on_fp8_weights(tiny_model_dirs, monkeypatch, fp8_gemv_input):
    """With the decode GEMV on, an FP8 model's decode steps read the FP8 weights in the GEMV (prefill stays on the
    FP8 matmul): its greedy tokens' logprobs stay within bfloat16's own cost of those of the model without it, up to
    the first token where the two choose differently."""
    from raylm.config import KernelConfig
    from raylm.kernels import triton_gemv

    path = tiny_model_dirs["llama"]
    fp8_calls = []
    gemv, gemv_silu_mul = triton_gemv.gemv, triton_gemv.gemv_silu_mul

    def counted(kernel):
        def run(x, weight, *args, **kw):
            fp8_calls.append(weight.dtype == FP8_DTYPE)
            return kernel(x, weight, *args, **kw)
        return run

    monkeypatch.setattr(triton_gemv, "gemv", counted(gemv))
    monkeypatch.setattr(triton_gemv, "gemv_silu_mul", counted(gemv_silu_mul))
    params = SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True)

    def generated(**kwargs) -> list[list[tuple[int, float]]]:
        with LLM(str(path), skip_tokenizer_init=True, kv_cache_config=KV, quant_config=FP8, device="cuda",
                 executor="local", **kwargs) as llm:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        return [[(token, position[token].logprob) for token, position in zip(out.outputs[0].token_ids,
                                                                             out.outputs[0].logprobs)]
                for out in outputs]

    with_gemv = generated(dtype="bfloat16", kernel_config=KernelConfig(decode_gemv=True,
                                                                      fp8_gemv_input=fp8_gemv_input))
    assert any(fp8_calls)  # the decoder's layers (the LM head keeps its bfloat16 weight)
    without = generated(dtype="bfloat16", kernel_config=KernelConfig(decode_gemv=False))
    precise = generated(dtype="float32")

    def gap(ours, theirs) -> torch.Tensor:
        gaps = []
        for one, other in zip(ours, theirs):
            for (token, logprob), (other_token, other_logprob) in zip(one, other):
                gaps.append(abs(logprob - other_logprob))
                if token != other_token:
                    break
        return torch.tensor(gaps).mean()

    assert gap(with_gemv, without) < 2 * gap(without, precise)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8_gemv_input", ["fp8", "fp8_rows"])
def test_the_fp8_input_gemv_takes_the_norms_fp8_rows_as_its_own_quantization_would(tiny_model_dirs, monkeypatch,
                                                                                   fp8_gemv_input):
    """With the GEMV taking its input in FP8 (fp8_gemv_input "fp8"), the RMSNorms before qkv and gate / up write
    the decode steps' rows in FP8 (no quantizer kernel before those GEMVs): the same bytes as the GEMV's own
    quantization, so the same tokens and logprobs, bit for bit. Under "fp8_rows" the layers after no norm (o,
    down) take float16 instead; with no rows handed over, so would qkv and gate / up: other logprobs."""
    from raylm.config import KernelConfig
    from raylm.kernels import triton_ops
    from raylm.kernels.policy import GEMV_MAX_ROWS

    path = tiny_model_dirs["llama"]
    decode_rows = []
    norm = triton_ops.rms_norm_fp8
    monkeypatch.setattr(triton_ops, "rms_norm_fp8", lambda x, *args, **kw: decode_rows.append(
        x.shape[0] <= GEMV_MAX_ROWS) or norm(x, *args, **kw))
    params = SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True)

    def decoded() -> list[list[tuple[int, float]]]:  # the greedy tokens and their logprobs
        with LLM(str(path), skip_tokenizer_init=True, kv_cache_config=KV, quant_config=FP8, device="cuda",
                 executor="local", dtype="bfloat16",
                 kernel_config=KernelConfig(decode_gemv=True, fp8_gemv_input=fp8_gemv_input)) as llm:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        return [[(token, position[token].logprob) for token, position in zip(out.outputs[0].token_ids,
                                                                             out.outputs[0].logprobs)]
                for out in outputs]

    handed_over = decoded()
    assert any(decode_rows)
    monkeypatch.setattr(ColumnParallelLinear, "takes_fp8_rows", lambda self, x: False)
    if fp8_gemv_input == "fp8":
        assert decoded() == handed_over
    else:
        assert decoded() != handed_over


# ------------------------------------------------------------------ update_weights


def test_update_weights_in_the_models_dtype_are_quantized_on_the_way_in(tmp_path, tiny_model_dirs):
    source = tiny_model_dirs["qwen3_moe"]
    hf_config = load_hf_config(resolve_model(str(source)))
    model = _load(source, Fp8Weights())
    perturbed, named = perturbed_hf_model(source)
    check_update(named, checkpoint_shapes(hf_config), torch.float32, "Qwen3MoeForCausalLM")
    assert apply_update(model, named) > 0
    perturbed.save_pretrained(tmp_path)
    _assert_same_state(model, _load(tmp_path, Fp8Weights()))
    with pytest.raises(ValueError, match=re.escape("is torch.bfloat16, the engine's weights are torch.float32")):
        check_update([(name, tensor.bfloat16()) for name, tensor in named[:1]], checkpoint_shapes(hf_config),
                     torch.float32, "Qwen3MoeForCausalLM")


# ------------------------------------------------------------------ tensor parallelism

def _row_parallel_in_halves(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
    """RowParallelLinear.forward of one rank computing what two ranks do: each half of the input columns quantized
    per token on its own, times its half of the weight, the partial sums added."""
    halves = zip(x.chunk(2, dim=-1), self.weight.chunk(2, dim=-1))
    out = sum(linear(part, weight, None, self.kernels, self.weight_scale) for part, weight in halves)
    return out if self.bias is None else out + self.bias


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fp8_at_tensor_parallel_size_2_equals_one_rank_quantizing_each_ranks_half(ray_cluster, tiny_model_dirs,
                                                                                  arch, monkeypatch):
    """Two ranks over gloo, against one rank whose row-parallel layers (o, down, the experts' down) quantize each
    half of their input apart, as the two ranks each quantize theirs: equal up to the order of the partial sums."""
    path = tiny_model_dirs[arch]
    two = _generate(path, quant_config=FP8, tensor_parallel_size=2)
    expert_linear = moe.linear
    moe_intermediate = 32

    def experts_in_halves(x, weight, bias, policy, scale):
        if x.shape[-1] != moe_intermediate:  # gate_up: every rank quantizes the whole hidden state
            return expert_linear(x, weight, bias, policy, scale)
        return sum(expert_linear(part, half, None, policy, scale)
                   for part, half in zip(x.chunk(2, dim=-1), weight.chunk(2, dim=-1)))

    monkeypatch.setattr(RowParallelLinear, "forward", _row_parallel_in_halves)
    monkeypatch.setattr(moe, "linear", experts_in_halves)
    one = _generate(path, quant_config=FP8, executor="local")
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
    gaps = [abs(a - b) for (_, ours), (_, theirs) in zip(two, one) for a, b in zip(ours, theirs)]
    assert max(gaps) < 1e-4
