"""The batched LoRA kernels (kernels/triton_lora.py) against kernels/lora.py's add_lora: rows of several adapters
and of none in one launch, plain and fused (q / k / v, gate / up) layers, ranks padded to the slots' width."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels.lora import add_lora  # noqa: E402
from raylm.kernels.triton_lora import add_lora_rows  # noqa: E402

pytestmark = MODULE_MARKS


def _case(slice_sizes: list[int], k: int, rank: int, dtype: torch.dtype, row_slots: list[int]):
    generator = torch.Generator().manual_seed(sum(slice_sizes) + k + rank)
    slots = 3
    n = sum(slice_sizes)
    lora_a = torch.randn(slots, len(slice_sizes) * rank, k, generator=generator) / k**0.5
    lora_b = torch.randn(slots, n, rank, generator=generator) / rank
    lora_a[1, :, :] = 0.0  # an empty slot
    lora_b[2, :, rank // 2 :] = 0.0  # an adapter of half the slots' rank
    lora_a[2, :, :][torch.arange(len(slice_sizes) * rank) % rank >= rank // 2] = 0.0
    x = torch.randn(len(row_slots), k, generator=generator)
    out = torch.randn(len(row_slots), n, generator=generator)
    return [t.to(DEVICE, dtype) for t in (out, x, lora_a, lora_b)]


def _groups(row_slots: list[int]):
    groups = []
    for slot in sorted({s for s in row_slots if s >= 0}):
        rows = [i for i, s in enumerate(row_slots) if s == slot]
        groups.append((slot, None if len(rows) == len(row_slots) else torch.tensor(rows, device=DEVICE)))
    return groups


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=GPU_ONLY)])
@pytest.mark.parametrize(("slice_sizes", "k"), [([96], 80), ([64, 32, 32], 64), ([48, 48], 200), ([40, 24], 600)],
                         ids=str)  # 600: three chunks of the shrink, the last one short
@pytest.mark.parametrize("row_slots", [[0, -1, 2, 0, 1], [2], [-1, -1]], ids=str)
def test_each_row_adds_its_own_adapter_as_the_reference_does(dtype, slice_sizes, k, row_slots):
    out, x, lora_a, lora_b = _case(slice_sizes, k, 8, dtype, row_slots)
    expected = add_lora(out.float().clone(), x.float(), lora_a.float(), lora_b.float(), slice_sizes,
                        _groups(row_slots))
    got = add_lora_rows(out.clone(), x, lora_a, lora_b, slice_sizes, torch.tensor(row_slots, device=DEVICE))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_slices_that_do_not_fit_the_slots_are_refused():
    out, x, lora_a, lora_b = _case([32, 32], 16, 4, torch.float32, [0])
    with pytest.raises(ValueError, match="do not fit"):
        add_lora_rows(out, x, lora_a, lora_b, [32, 16], torch.tensor([0], device=DEVICE))


def test_a_row_s_product_does_not_depend_on_its_batch():
    """The shrink's chunks are set by the input's width alone: each row of a batch gets the bytes it gets alone."""
    row_slots = [0, 2, -1, 1, 0]
    out, x, lora_a, lora_b = _case([40, 24], 600, 8, torch.float32, row_slots)
    batched = add_lora_rows(out.clone(), x, lora_a, lora_b, [40, 24], torch.tensor(row_slots, device=DEVICE))
    for row, slot in enumerate(row_slots):
        alone = add_lora_rows(out[row : row + 1].clone(), x[row : row + 1], lora_a, lora_b, [40, 24],
                              torch.tensor([slot], device=DEVICE))
        assert torch.equal(alone, batched[row : row + 1])


def test_the_products_in_a_buffer_of_their_own_are_the_rows_products_and_zeros_without_an_adapter():
    """lora_products: each row's product into a float32 buffer of its own, added to the layer's output once the
    side stream that computed it beside the GEMV joins."""
    from raylm.kernels.triton_lora import lora_products, lora_shrink

    slices, row_slots = [40, 24], [0, 2, -1, 1, 0]
    out, x, lora_a, lora_b = _case(slices, 600, 8, torch.float32, row_slots)
    slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    products = lora_products(lora_shrink(x, lora_a, lora_b, slices, slots))
    expected = add_lora(torch.zeros_like(out), x, lora_a, lora_b, slices, _groups(row_slots))
    assert products.dtype == torch.float32 and torch.equal(products[2], torch.zeros_like(products[2]))
    torch.testing.assert_close(products, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ segments (steps of more rows than decode's)

# Runs of rows of one slot as a prefill makes them: a run longer than a block, the base model's rows, a run of
# the empty slot, one row alone, and a slot seen again after others.
_SEGMENT_ROWS = [0] * 45 + [-1] * 5 + [2] * 20 + [1] * 3 + [2] + [0] * 2


def test_segment_blocks_cut_runs_of_one_slot_into_blocks():
    from raylm.kernels.triton_lora import segment_blocks

    blocks = segment_blocks([0] * 5 + [-1] * 2 + [3] * 3 + [0], block_rows=4)
    assert blocks.tolist() == [[0, 4, 0], [4, 1, 0], [7, 3, 3], [10, 1, 0]]
    assert segment_blocks([-1, -1]).shape == (0, 3) and segment_blocks([]).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=GPU_ONLY)])
@pytest.mark.parametrize(("slice_sizes", "k", "rank"),
                         [([96], 80, 8), ([64, 32, 32], 64, 8), ([40, 24], 600, 8), ([70, 20, 30], 300, 64)], ids=str)
@pytest.mark.parametrize("programs", [512, 1], ids=["chunks_of_256", "one_chunk"])
def test_segments_add_each_run_s_adapter_as_the_reference_does(dtype, slice_sizes, k, rank, programs, monkeypatch):
    """add_lora_segments: each block's rows times their slot's A and B on the tensor cores, in two launches; slices
    whose ends fall inside an output tile, ranks padded to the slots' width, 3 x 64 ranks in one tile; the input in
    256-wide chunks (few blocks), or in one (blocks enough to keep the GPU busy)."""
    from raylm.kernels import triton_lora
    from raylm.kernels.triton_lora import add_lora_segments, segment_blocks

    monkeypatch.setattr(triton_lora, "SEGMENT_PROGRAMS", programs)

    out, x, lora_a, lora_b = _case(slice_sizes, k, rank, dtype, _SEGMENT_ROWS)
    expected = add_lora(out.float().clone(), x.float(), lora_a.float(), lora_b.float(), slice_sizes,
                        _groups(_SEGMENT_ROWS))
    blocks = torch.from_numpy(segment_blocks(_SEGMENT_ROWS)).to(DEVICE)
    got = add_lora_segments(out.clone(), x, lora_a, lora_b, slice_sizes, blocks)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(got[45:50], out[45:50])  # the base model's rows are not written


def test_segments_refuse_layers_wider_than_their_tile():
    from raylm.kernels.triton_lora import SEGMENT_MAX_RANKS, add_lora_segments

    rank = SEGMENT_MAX_RANKS // 2 + 16
    out, x, lora_a, lora_b = _case([32, 32], 16, rank, torch.float32, [0])
    with pytest.raises(ValueError, match="at most 3 slices and"):
        add_lora_segments(out, x, lora_a, lora_b, [32, 32], torch.zeros(1, 3, dtype=torch.int32, device=DEVICE))


def test_linear_runs_the_plain_gemv_then_the_expand_with_the_reference_sums(monkeypatch):
    """kernel_config.lora_expand 'kernel': linear runs the layer's GEMV as without adapters, then the expand kernel
    adds the rows' products to its output."""
    from raylm.kernels import triton_gemv
    from raylm.kernels.linear import linear
    from raylm.kernels.policy import KernelPolicy
    from raylm.kernels.triton_lora import lora_shrink

    class DecodePolicy(KernelPolicy):
        def gemv_applies(self, x, weight):  # the real policy takes only CUDA tensors
            return True

    slices, k, rank, row_slots = [32, 32], 300, 8, [1, -1, 0]
    out, x, lora_a, lora_b = _case(slices, k, rank, torch.float16, row_slots)
    weight = (torch.randn(sum(slices), k, generator=torch.Generator().manual_seed(7)) / k**0.5).to(DEVICE, x.dtype)
    slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    gemv, handed = triton_gemv.gemv, []
    monkeypatch.setattr(triton_gemv, "gemv", lambda *args, **kwargs: handed.append(args[1].shape)
                        or gemv(*args, **kwargs))
    policy = DecodePolicy(triton=True, decode_gemv=True)
    got = linear(x, weight, None, policy, lora=lora_shrink(x, lora_a, lora_b, slices, slots))
    assert handed == [weight.shape]
    expected = add_lora(x.float() @ weight.float().T, x.float(), lora_a.float(), lora_b.float(), slices,
                        _groups(row_slots))
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)


def test_products_beside_the_gemv_fork_before_it_join_after_and_add_the_reference_sums(monkeypatch):
    """kernel_config.lora_expand 'beside': an adapted layer queues the shrink and the products on the side stream
    (between fork and join), the layer's matmul on its own stream, then adds the products once joined."""
    import raylm.models.lora as lora_module
    from raylm.kernels import triton_lora
    from raylm.kernels.policy import KernelPolicy
    from raylm.models.lora import LayerAdapters, LoraBatch

    class DecodePolicy(KernelPolicy):
        def on_triton(self, x):  # the real policy takes only CUDA tensors
            return True

    events = []

    class Side:
        def fork(self):
            events.append("fork")
            return contextlib.nullcontext()

        def join(self):
            events.append("join")

    slices, k, rank, row_slots = [32, 16, 16], 96, 8, [1, -1, 2, 0]
    out, x, lora_a, lora_b = _case(slices, k, rank, torch.float32, row_slots)
    weight = torch.randn(sum(slices), k, generator=torch.Generator().manual_seed(3)).to(DEVICE) / k**0.5
    batch = LoraBatch()
    batch.side, batch.in_graph = Side(), True
    batch.graph_slots = torch.tensor(row_slots + [0, 0], dtype=torch.int32, device=DEVICE)  # a graph's buffer
    layer = SimpleNamespace(weight=torch.empty(sum(slices), k, device=DEVICE), _load=None)
    adapters = LayerAdapters(layer, ["q", "k", "v"], slices, False, batch, 3, rank, torch.float32)
    adapters.lora_a.copy_(lora_a)
    adapters.lora_b.copy_(lora_b)
    adapters.kernels = DecodePolicy(triton=True, lora_beside=True)
    products, linear = triton_lora.lora_products, lora_module.linear
    monkeypatch.setattr(triton_lora, "lora_products",
                        lambda *args, **kwargs: events.append("products") or products(*args, **kwargs))
    monkeypatch.setattr(lora_module, "linear", lambda *args, **kwargs: events.append("matmul") or linear(*args,
                                                                                                         **kwargs))
    got = adapters.linear(x, weight, None, None)
    assert events == ["fork", "products", "matmul", "join"]
    expected = add_lora(x @ weight.T, x, lora_a, lora_b, slices, _groups(row_slots))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="contiguous float32"):
        triton_lora.lora_products(triton_lora.lora_shrink(x, lora_a, lora_b, slices, batch.graph_slots[:4]),
                                  out=torch.empty(4, sum(slices), device=DEVICE, dtype=torch.float16))


@pytest.mark.parametrize("beside", [False, True], ids=["expand_kernel", "beside"])
def test_adapted_gate_up_leave_the_fused_silu_mul_gemv_for_the_reference_sums(tiny_model_dirs, monkeypatch, beside):
    """An MLP whose gate / up carry adapters runs their plain GEMV, then the SiLU-mul apart (the fused SiLU-mul GEMV
    would round gate / up before their products join): the expand kernel adds the products to the GEMV's output,
    or, computed beside it, the SiLU-mul adds them in its own pass. The reference's sums either way."""
    from raylm.kernels import triton_gemv, triton_ops
    from raylm.kernels.policy import KernelPolicy
    from raylm.models.llama import MLP
    from raylm.models.loader import load_hf_config
    from raylm.models.lora import LayerAdapters, LoraBatch
    from raylm.models.parallel import SINGLE
    from raylm.models.registry import resolve_architecture
    from raylm.models.source import resolve_model

    class DecodePolicy(KernelPolicy):  # the real policy takes only CUDA tensors
        def on_triton(self, x):
            return True

        def gemv_applies(self, x, weight):
            return True

    arch = resolve_architecture(load_hf_config(resolve_model(str(tiny_model_dirs["llama"]))))[1]
    mlp = MLP(arch, SINGLE).to(DEVICE)
    generator = torch.Generator().manual_seed(11)
    for parameter in mlp.parameters():
        parameter.data = (torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5).to(
            DEVICE, torch.float16)
    size, rank, row_slots = arch.intermediate_size, 8, [1, -1, 0]
    batch = LoraBatch()
    batch.in_graph = True
    batch.graph_slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    if beside:
        batch.side = SimpleNamespace(fork=contextlib.nullcontext, join=lambda: None)
    adapters = LayerAdapters(mlp.gate_up_proj, [0, 1], [size, size], False, batch, 2, rank, torch.float16)
    adapters.lora_a.copy_(torch.randn(adapters.lora_a.shape, generator=generator) / arch.hidden_size**0.5)
    adapters.lora_b.copy_(torch.randn(adapters.lora_b.shape, generator=generator) / rank)
    mlp.gate_up_proj.lora = adapters
    x = torch.randn(len(row_slots), arch.hidden_size, generator=generator).to(DEVICE, torch.float16)
    gate_up = add_lora(x.float() @ mlp.gate_up_proj.weight.float().T, x.float(), adapters.lora_a.float(),
                       adapters.lora_b.float(), [size, size], _groups(row_slots))
    expected = (torch.nn.functional.silu(gate_up[:, :size]) * gate_up[:, size:]) @ mlp.down_proj.weight.float().T
    fused, handed = triton_gemv.gemv_silu_mul, []
    monkeypatch.setattr(triton_gemv, "gemv_silu_mul", lambda *args, **kwargs: handed.append(args) or fused(
        *args, **kwargs))
    silu_and_mul, extras = triton_ops.silu_and_mul, []
    monkeypatch.setattr(triton_ops, "silu_and_mul", lambda *args, **kwargs: extras.append(
        kwargs.get("extra") is not None) or silu_and_mul(*args, **kwargs))
    policy = DecodePolicy(triton=True, decode_gemv=True, lora_beside=beside)
    mlp.kernels = adapters.kernels = mlp.gate_up_proj.kernels = mlp.down_proj.kernels = policy
    got = mlp(x)
    assert handed == [] and extras == [beside]
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_row_parallel_layer_leaves_its_products_beside_to_the_norm_after_it(bias):
    """kernel_config.lora_expand 'beside' on o / down (one rank, no bias): the layer returns its output with the
    products still to add (PendingProducts), which the RMSNorm after it adds in its own kernel; with a bias the
    layer adds them itself. Either way the sums are the reference's."""
    from raylm.kernels.policy import KernelPolicy
    from raylm.models.lora import LayerAdapters, LoraBatch
    from raylm.models.parallel import SINGLE, RowParallelLinear

    class DecodePolicy(KernelPolicy):  # the real policy takes only CUDA tensors
        def on_triton(self, x):
            return True

    class Side:
        def fork(self):
            return contextlib.nullcontext()

        def join(self):
            pass

    k, n, rank, row_slots = 96, 64, 8, [1, -1, 0]
    out, x, lora_a, lora_b = _case([n], k, rank, torch.float32, row_slots)
    layer = RowParallelLinear(k, n, bias, SINGLE).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(9)) / k**0.5)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(10)))
    batch = LoraBatch()
    batch.side, batch.in_graph = Side(), True
    batch.graph_slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    adapters = LayerAdapters(layer, [None], [n], True, batch, 3, rank, torch.float32)
    adapters.lora_a.copy_(lora_a)
    adapters.lora_b.copy_(lora_b)
    layer.lora = adapters
    layer.kernels = adapters.kernels = DecodePolicy(triton=True, lora_beside=True)
    with torch.no_grad():
        got = layer(x)
    expected = add_lora(x @ layer.weight.T, x, lora_a, lora_b, [n], _groups(row_slots))
    if bias:
        assert isinstance(got, torch.Tensor)
        expected = expected + layer.bias
    else:
        assert hasattr(got, "products")
        got = got.materialize()
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)
