"""Benchmark result names record the run's layout, attention backend and the settings it changed (--set), so
that a run with a setting changed never overwrites the default run's result; --set reaches the engine's
arguments."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.common import add_model_args, llm_options, run_suffix
from raylm.config import LlmArgs
from raylm.serving.config_sources import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    return parser.parse_args(list(argv))


def test_default_runs_have_no_suffix():
    assert run_suffix(_args()) == ""


def test_layout_backend_and_settings_are_named_in_order():
    args = _args("--tp", "2", "--attention_backend", "flashinfer", "--set", "kernel_config.decode_gemv=true",
                 "--set", "kernel_config.symmetric_memory_allreduce=false", "--set", "kernel_config.pdl=exit",
                 "--set", "disable_pipeline_overlap=true")
    assert run_suffix(args) == ("-tp2-flashinfer-decode_gemv-nosymmetric_memory_allreduce-pdl-exit"
                                "-disable_pipeline_overlap")
    assert run_suffix(_args("--pp", "2", "--set", "cuda_graph_config.capture_logits=false")) == "-pp2-nocapture_logits"


def test_settings_reach_the_engine_arguments_beside_the_flags():
    options = llm_options(_args("--max_batch_size", "8", "--set", "kernel_config.pdl=off",
                                "--set", "kv_cache_config.tokens_per_block=16"), max_seq_len=64)
    args = LlmArgs(**{**options, "model": "m"})
    assert args.kernel_config.pdl == "off" and args.max_batch_size == 8
    assert args.kv_cache_config.tokens_per_block == 16 and args.kv_cache_config.enable_block_reuse is False


def test_unknown_settings_are_rejected_naming_the_path():
    with pytest.raises(ConfigError, match="kernel_config.no_such"):
        llm_options(_args("--set", "kernel_config.no_such=1"), max_seq_len=64)
