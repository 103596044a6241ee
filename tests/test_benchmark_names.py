"""Benchmark result names record the run's layout, attention backend and experimental kernel switches, so that
runs with a switch on never overwrite the default run's result."""

from __future__ import annotations

import argparse

from benchmarks.common import run_suffix


def _args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"tp": 1, "pp": 1, "attention_backend": "auto", **overrides})


def test_default_runs_have_no_suffix(monkeypatch):
    for name in ("RAYLM_TRITON_GEMV", "RAYLM_SYMM_MEM_ALLREDUCE", "RAYLM_ALLREDUCE_NORM", "RAYLM_L2_PREFETCH",
                 "RAYLM_PP_OVERLAP", "RAYLM_PDL", "RAYLM_GRAPH_LOGITS"):
        monkeypatch.delenv(name, raising=False)
    assert run_suffix(_args()) == ""


def test_layout_backend_and_switches_are_named_in_order(monkeypatch):
    monkeypatch.setenv("RAYLM_TRITON_GEMV", "1")
    monkeypatch.setenv("RAYLM_SYMM_MEM_ALLREDUCE", "0")
    monkeypatch.setenv("RAYLM_ALLREDUCE_NORM", "1")
    monkeypatch.setenv("RAYLM_L2_PREFETCH", "1")
    monkeypatch.setenv("RAYLM_PP_OVERLAP", "0")
    monkeypatch.setenv("RAYLM_PDL", "1")
    expected = "-tp2-flashinfer-gemv-nosymm-norm-l2-nooverlap-pdl"
    assert run_suffix(_args(tp=2, attention_backend="flashinfer")) == expected
    monkeypatch.setenv("RAYLM_PP_OVERLAP", "1")
    assert run_suffix(_args(pp=2)) == "-pp2-gemv-nosymm-norm-l2-overlap-pdl"
    monkeypatch.setenv("RAYLM_L2_PREFETCH_MIB", "24")
    assert run_suffix(_args(pp=2)) == "-pp2-gemv-nosymm-norm-l2-24mib-overlap-pdl"
    monkeypatch.delenv("RAYLM_SYMM_MEM_ALLREDUCE")
    monkeypatch.delenv("RAYLM_L2_PREFETCH_MIB")
    monkeypatch.delenv("RAYLM_PP_OVERLAP")
    monkeypatch.setenv("RAYLM_PDL", "0")
    monkeypatch.delenv("RAYLM_ALLREDUCE_NORM")
    monkeypatch.delenv("RAYLM_L2_PREFETCH")
    assert run_suffix(_args()) == "-gemv-nopdl"


def test_switches_set_off_against_a_default_that_can_be_on_are_named(monkeypatch):
    """The GEMV and PDL are on by default for weight-streaming models (kernels/dispatch.py), the symmetric
    all-reduce and the fused all-reduce + norm for TP > 1 on GPUs, overlapped steps for pipelines: a run that
    turns them off must not overwrite the default run's result; the L2 prefetch is off by default."""
    monkeypatch.setenv("RAYLM_TRITON_GEMV", "0")
    monkeypatch.setenv("RAYLM_SYMM_MEM_ALLREDUCE", "0")
    monkeypatch.setenv("RAYLM_ALLREDUCE_NORM", "0")
    monkeypatch.setenv("RAYLM_L2_PREFETCH", "0")
    monkeypatch.setenv("RAYLM_PP_OVERLAP", "0")
    monkeypatch.setenv("RAYLM_PDL", "0")
    monkeypatch.setenv("RAYLM_GRAPH_LOGITS", "0")
    assert run_suffix(_args(tp=2)) == "-tp2-nogemv-nosymm-nonorm-nooverlap-nographlogits-nopdl"


def test_pdl_trigger_modes_other_than_the_default_are_named(monkeypatch):
    monkeypatch.delenv("RAYLM_TRITON_GEMV", raising=False)
    monkeypatch.delenv("RAYLM_SYMM_MEM_ALLREDUCE", raising=False)
    monkeypatch.delenv("RAYLM_ALLREDUCE_NORM", raising=False)
    monkeypatch.delenv("RAYLM_L2_PREFETCH", raising=False)
    monkeypatch.delenv("RAYLM_PP_OVERLAP", raising=False)
    for mode, suffix in (("start", "-pdl"), ("exit", "-pdl-exit"), ("tail", "-pdl-tail"),
                         ("after_wait", "-pdl-after_wait")):
        monkeypatch.setenv("RAYLM_PDL", mode)
        assert run_suffix(_args()) == suffix
