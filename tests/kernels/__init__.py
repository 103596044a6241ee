"""Where the Triton kernel tests run: on CUDA when there is a device, otherwise under the Triton interpreter
on the CPU when RAYLM_TRITON_INTERPRET=1 (slow; those runs are marked `slow`), otherwise not at all."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
INTERPRETED = not ON_CUDA and os.environ.get("RAYLM_TRITON_INTERPRET") == "1"

# Marks of a case that only runs on CUDA (half precision, large shapes).
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")]
# Marks of a whole kernel test module: interpreter runs take minutes.
MODULE_MARKS = [pytest.mark.slow] if INTERPRETED else []


def import_triton() -> None:
    """Imports Triton for the calling test module (skipping it without Triton), interpreted where
    RAYLM_TRITON_INTERPRET=1: the switch is read when Triton and the kernels are imported, so it is set first."""
    if INTERPRETED:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    if INTERPRETED:
        _take_single_element_as_index()


def kernel_device() -> torch.device:
    """The device of the calling test module; skips the module where Triton cannot run."""
    if not ON_CUDA and not INTERPRETED:
        pytest.skip("Triton kernels need a CUDA device, or RAYLM_TRITON_INTERPRET=1 to run them interpreted",
                    allow_module_level=True)
    import_triton()
    return torch.device("cuda" if ON_CUDA else "cpu")


def _take_single_element_as_index() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with int(array of shape (1,)), which
    NumPy >= 2.4 refuses (triton-lang/triton#9171); its tensors get an __index__ that takes the element."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "takes_single_element", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.takes_single_element = True
    interpreter._patch_lang_tensor = patched


def tiny_runner(model_dir, dtype: torch.dtype, device: torch.device, num_blocks: int = 4):
    """A ModelRunner over the tiny checkpoint in model_dir (16-token blocks, its cache allocated) and its
    LoadedModel, for tests that drive the model through the runner's kernels directly."""
    from raylm.engine.model_runner import ModelRunner
    from raylm.models.loader import load_hf_config, load_model
    from raylm.models.source import resolve_model

    source = resolve_model(str(model_dir))
    loaded = load_model(source, load_hf_config(source), dtype, device, max_positions=512)
    runner = ModelRunner(loaded.model, loaded.arch, device, dtype, block_size=16)
    runner.allocate_kv_cache(num_blocks, dtype)
    return runner, loaded
