"""Device memory by tag (engine/device_memory.py): release frees a tag's tensors, resume brings them back (weights
from their host copy, or empty for a caller to refill), and both are idempotent."""

from __future__ import annotations

import pytest
import torch

from raylm.engine.device_memory import TAGS, TaggedMemory
from tests.kernels import tiny_runner


def _memory(tiny_model_dirs, weight_restore="host_copy"):
    runner, _ = tiny_runner(tiny_model_dirs["llama"], torch.float32, torch.device("cpu"))
    captures = []
    return runner, TaggedMemory(runner, lambda: captures.append(1), weight_restore), captures


def _weights(runner) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in runner.model.named_parameters()}


def test_every_tag_is_freed_and_restored_and_twice_is_once(tiny_model_dirs):
    runner, memory, _ = _memory(tiny_model_dirs)
    before, held = _weights(runner), memory.status()
    assert all(entry["resident"] for entry in held.values()) and held["model_weights"]["bytes"] > 0
    kv_shape = runner.kv_caches[0][0].shape
    memory.release(list(TAGS))
    memory.release(["kv_cache", "model_weights"])
    assert all(param.numel() == 0 for param in runner.model.parameters()) and runner.kv_caches == []
    assert all(buffer.numel() == 0 for buffer in runner.model.buffers())
    released = memory.status()
    assert not any(entry["resident"] for entry in released.values())
    assert {tag: e["bytes"] for tag, e in released.items()} == {tag: e["bytes"] for tag, e in held.items()}
    memory.resume(list(TAGS))
    memory.resume(["model_weights"])
    after = _weights(runner)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert runner.kv_caches[0][0].shape == kv_shape and bool((runner.kv_caches[0][0][0] == 0).all())


def test_discarded_weights_come_back_empty_for_the_caller_to_refill(tiny_model_dirs):
    runner, memory, _ = _memory(tiny_model_dirs, weight_restore="discard")
    shapes = {name: param.shape for name, param in runner.model.named_parameters()}
    memory.release(["model_weights"])
    memory.resume(["model_weights"])
    assert {name: param.shape for name, param in runner.model.named_parameters()} == shapes


class _CapturedGraphs:
    freed = False

    def free(self):
        self.freed = True


def test_graphs_are_captured_again_once_weights_cache_and_graphs_are_back(tiny_model_dirs):
    runner, memory, captures = _memory(tiny_model_dirs)
    memory.release(["kv_cache"])
    memory.resume(["kv_cache"])
    assert captures == []  # no graphs were held (the CPU captures none): nothing to re-capture
    graphs = _CapturedGraphs()
    runner.graphs = graphs  # as if captured
    memory.release(["kv_cache", "model_weights"])
    assert runner.graphs is None and graphs.freed
    memory.resume(["kv_cache"])
    assert captures == []  # the weights are still away
    memory.resume(["model_weights"])
    assert captures == [1]


def test_unknown_tags_are_refused_with_the_tags():
    with pytest.raises(ValueError, match="unknown memory tags \\['weights'\\]"):
        TaggedMemory.release(None, ["weights"])
    with pytest.raises(TypeError, match="list of tag names"):
        TaggedMemory.resume(None, "kv_cache")


class _FakeFixedAddresses:
    """Stands in for torch-memory-saver on the CPU: records pauses and resumes; a resumed tag's pages come back
    holding ones, as reused device pages hold whatever was there."""

    def __init__(self, runner):
        self.runner = runner
        self.calls = []

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))
        if tag == "kv_cache":
            for k_cache, v_cache in self.runner.kv_caches:
                k_cache.fill_(1.0)
                v_cache.fill_(1.0)


def test_kept_addresses_pause_and_resume_in_place_and_keep_the_graphs(tiny_model_dirs):
    runner, _ = tiny_runner(tiny_model_dirs["llama"], torch.float32, torch.device("cpu"))
    captures = []
    fixed = _FakeFixedAddresses(runner)
    memory = TaggedMemory(runner, lambda: captures.append(1), "discard", fixed)
    caches, weights = runner.kv_caches, [param.data for param in runner.model.parameters()]
    graphs = _CapturedGraphs()
    runner.graphs = graphs
    memory.release(["model_weights", "kv_cache", "model"])
    memory.release(["kv_cache"])
    assert fixed.calls == [("pause", "model_weights"), ("pause", "kv_cache"), ("pause", "model")]
    assert runner.graphs is graphs and not graphs.freed  # the graphs' addresses stay valid
    assert runner.kv_caches is caches
    assert all(param.data.data_ptr() == old.data_ptr() for param, old in zip(runner.model.parameters(), weights))
    memory.resume(list(TAGS))
    assert fixed.calls[3:] == [("resume", "model_weights"), ("resume", "kv_cache"), ("resume", "model")]
    assert captures == []  # nothing to capture again
    assert bool((caches[0][0][0] == 0).all()) and bool((caches[0][0][1] == 1).all())  # the null block zeroed

    memory.release(["cuda_graph", "kv_cache"])  # the graphs' own memory is dropped, and captured again on resume
    assert runner.graphs is None and graphs.freed
    memory.resume(["kv_cache"])
    assert captures == []
    memory.resume(["cuda_graph"])
    assert captures == [1]


def test_kept_addresses_are_chosen_by_config_and_refused_where_they_cannot_be(monkeypatch):
    from raylm.engine.device_memory import fixed_addresses

    assert fixed_addresses(None, torch.device("cpu")) is None
    assert fixed_addresses(False, torch.device("cuda")) is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fixed_addresses(True, torch.device("cpu"))
    monkeypatch.setitem(__import__("sys").modules, "torch_memory_saver", None)  # not installed
    assert fixed_addresses(None, torch.device("cuda")) is None
    with pytest.raises(ValueError, match="pip install torch-memory-saver"):
        fixed_addresses(True, torch.device("cuda"))
