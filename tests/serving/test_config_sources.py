"""Layering ServeArgs: defaults < --config file < CLI flags < --set, paths checked, values parsed as YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raylm.serving.config import ServeArgs
from raylm.serving.config_sources import ConfigError, config_paths, layer_serve_args, parse_assignment


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_each_source_overrides_the_one_before_it(tmp_path):
    config = _file(tmp_path, "max_batch_size: 8\nmax_num_tokens: 1024\nmax_seq_len: 512\n")
    args = layer_serve_args(config, {"max_num_tokens": 2048, "max_seq_len": 768, "port": None},
                            ["max_seq_len=640"])
    assert (args.max_batch_size, args.max_num_tokens, args.max_seq_len) == (8, 2048, 640)
    assert args.port == 8000  # a flag given as None is not given


def test_an_assignment_replaces_exactly_the_value_it_addresses(tmp_path):
    config = _file(tmp_path, "kv_cache_config:\n  max_tokens: 2048\n  tokens_per_block: 16\n")
    leaf = layer_serve_args(config, {}, ["kv_cache_config.max_tokens=4096"])
    assert (leaf.kv_cache_config.max_tokens, leaf.kv_cache_config.tokens_per_block) == (4096, 16)
    whole = layer_serve_args(config, {}, ["kv_cache_config={max_tokens: 1024}"])
    assert (whole.kv_cache_config.max_tokens, whole.kv_cache_config.tokens_per_block) == (1024, 32)
    assert layer_serve_args(None, {}, ["autoscaling_config.max_replicas=3"]).autoscaling_config.max_replicas == 3


def test_values_are_yaml_and_the_last_duplicate_wins():
    assert parse_assignment("max_seq_len=null") == ("max_seq_len", None)
    assert parse_assignment("trust_remote_code=true") == ("trust_remote_code", True)
    assert parse_assignment("cuda_graph_config.batch_sizes=[1, 2, 4]") == ("cuda_graph_config.batch_sizes",
                                                                           [1, 2, 4])
    assert parse_assignment("chat_template='{{ x }}'") == ("chat_template", "{{ x }}")
    assert layer_serve_args(None, {}, ["max_batch_size=2", "max_batch_size=3"]).max_batch_size == 3


@pytest.mark.parametrize(("assignments", "message"), [
    (["kv_cache_config.max_token=1"], "valid paths under 'kv_cache_config': kv_cache_config.dtype"),
    (["frobnicate=1"], "valid paths at the top level: api_key"),
    (["max_batch_size.x=1"], "'max_batch_size' is a value, not a mapping"),
    (["kv_cache_config={max_tokenz: 5}"], "unknown config path 'kv_cache_config.max_tokenz'"),
    (["model=x"], "give the model as the MODEL argument"),
    (["max_batch_size=.inf"], "numbers must be finite"),
    (["served_model_name=2024-01-01"], "quote it to pass a string"),
    (["max_batch_size"], "expected PATH=VALUE"),
    (["kv_cache_config={max_tokens: 5}", "kv_cache_config.dtype=auto"], "conflict"),
    (["max_batch_size=0"], "max_batch_size: Input should be greater than or equal to 1 (got 0)"),
])
def test_bad_assignments_are_rejected_with_what_is_allowed(assignments, message):
    with pytest.raises(ConfigError) as info:
        layer_serve_args(None, {}, assignments)
    assert message in str(info.value)


@pytest.mark.parametrize(("text", "message"), [
    ("max_batch_sizes: 3\n", "unknown config path 'max_batch_sizes'"),
    ("kv_cache_config:\n  max_token: 3\n", "unknown config path 'kv_cache_config.max_token'"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("max_batch_size: [1\n", "not valid YAML"),
])
def test_bad_config_files_are_rejected_naming_the_file(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        layer_serve_args(_file(tmp_path, text))
    assert message in str(info.value) and "--config" in str(info.value)
    with pytest.raises(ConfigError, match="cannot read"):
        layer_serve_args(tmp_path / "missing.yaml")


def test_an_empty_file_sets_nothing_and_every_path_is_listed(tmp_path):
    assert layer_serve_args(_file(tmp_path, "")).max_batch_size == 256
    paths = config_paths()
    assert {"max_batch_size", "kv_cache_config.max_tokens", "autoscaling_config.max_replicas",
            "scheduler_config.capacity_scheduler_policy"} <= set(paths)
    assert paths == sorted(paths)


def test_engine_settings_come_from_the_config_file_and_set(tmp_path):
    """The kernel and pipeline settings are configuration like any other (no environment variable), listed among
    the paths --print_schema shows; a bare YAML `off` is the pdl mode 'off'."""
    config = _file(tmp_path, "kernel_config:\n  decode_gemv: true\ncuda_graph_config:\n  capture_logits: false\n")
    args = layer_serve_args(config, {}, ["kernel_config.pdl=off", "disable_pipeline_overlap=true",
                                         "kernel_config.fused_allreduce_norm=false"])
    kernels = args.kernel_config
    assert (kernels.decode_gemv, kernels.pdl, kernels.fused_allreduce_norm) == (True, "off", False)
    assert args.cuda_graph_config.capture_logits is False and args.disable_pipeline_overlap is True
    assert {"kernel_config.triton", "kernel_config.symmetric_memory_allreduce", "cuda_graph_config.capture_logits",
            "disable_pipeline_overlap", "scheduler_config.capacity_scheduler_policy"} <= set(config_paths())
    with pytest.raises(ConfigError, match="kernel_config.pdl"):
        layer_serve_args(None, {}, ["kernel_config.pdl=sometimes"])


def test_a_file_of_several_models_with_flags_and_set_as_every_models_defaults(tmp_path):
    config = _file(tmp_path, "port: 9000\nmodels:\n  - model: /models/llama\n    served_model_name: llama\n"
                             "  - model: /models/qwen\n    served_model_name: qwen\n    max_batch_size: 2\n")
    args = layer_serve_args(config, {"model": None, "max_batch_size": 8}, ["kv_cache_config.max_tokens=4096"])
    llama, qwen = args.served_models()
    assert (llama.model_name, llama.max_batch_size, llama.kv_cache_config.max_tokens) == ("llama", 8, 4096)
    assert (qwen.model_name, qwen.max_batch_size, qwen.kv_cache_config.max_tokens) == ("qwen", 2, 4096)
    assert llama.port == qwen.port == 9000


@pytest.mark.parametrize(("text", "flags", "assignments", "message"), [
    ("models:\n  - model: a\n    max_batch_sizes: 3\n", {}, [],
     "unknown config path 'models[0].max_batch_sizes'; valid paths under 'models[0]': models[0].attention_backend"),
    ("models:\n  - model: a\n    kv_cache_config: {max_tokenz: 3}\n", {}, [],
     "unknown config path 'models[0].kv_cache_config.max_tokenz'"),
    ("models:\n  - model: a\n  - model: b\n    max_batch_size: 0\n", {}, [],
     "models[1].max_batch_size: Input should be greater than or equal to 1 (got 0)"),
    ("models:\n  - model: a\n", {"model": "/models/x"}, [], "raylm serve's MODEL argument sets model there"),
    ("models:\n  - model: a\n", {}, ["models.0.max_batch_size=2"], "'models' is a value, not a mapping"),
    ("", {}, ["models=[{model: a, served_model_name: x}, {model: b, served_model_name: x}]"],
     "both served as 'x'"),
])
def test_bad_lists_of_models_are_rejected_naming_the_source_and_path(tmp_path, text, flags, assignments, message):
    with pytest.raises(ConfigError) as info:
        layer_serve_args(_file(tmp_path, text), flags, assignments)
    assert message in str(info.value)


def test_the_example_configs_are_valid():
    examples = Path(__file__).parents[2] / "examples" / "serving"
    assert layer_serve_args(examples / "config.yaml").model_name == "smollm2"
    names = [model.model_name for model in layer_serve_args(examples / "two_models.yaml").served_models()]
    assert names == ["smollm2", "smollm2-long"]
    serve_args = yaml.safe_load((examples / "serve_config.yaml").read_text())["applications"][0]["args"]
    assert ServeArgs.model_validate(serve_args).model_name == "smollm2"


def test_settings_inside_a_union_of_configs_are_addressed_by_their_fields(tmp_path):
    """speculative_config is one of two decoding types (its decoding_type says which): --set and files address
    the fields of either, and a path that is in neither is refused, listing both types' fields."""
    args = layer_serve_args(None, {}, ["speculative_config.decoding_type=NGram", "speculative_config.max_draft_len=3"])
    assert (args.speculative_config.decoding_type, args.speculative_config.max_draft_len) == ("NGram", 3)
    config = _file(tmp_path, "speculative_config:\n  decoding_type: DraftTarget\n  speculative_model: /models/d\n")
    assert layer_serve_args(config).speculative_config.speculative_model == "/models/d"
    assert {"speculative_config.max_matching_ngram_size", "speculative_config.speculative_model"} <= set(config_paths())
    with pytest.raises(ConfigError, match=r"unknown config path 'speculative_config.draft_len'.*speculative_model"):
        layer_serve_args(None, {}, ["speculative_config.draft_len=3"])
    with pytest.raises(ConfigError, match="unknown config path 'speculative_config.nope'"):
        layer_serve_args(_file(tmp_path, "speculative_config:\n  nope: 1\n"))
