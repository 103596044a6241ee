"""Weight transfer: tensor handles, flat buckets, the restricted payload unpickler and update_weights' value forms."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from raylm.rl_api.weight_transfer import (
    BUCKET_ALIGNMENT,
    decode_payload,
    encode_payload,
    open_handle,
    pack_bucket,
    tensor_handle,
    unpack_bucket,
    weights_for_device,
)


def _mixed_tensors(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(7, 5, generator=generator).to(device)),
        ("norm", torch.randn(3, generator=generator).to(device, torch.bfloat16)),
        ("proj", torch.randn(1, 13, 3, generator=generator).to(device, torch.float16)),
        ("ids", torch.randint(-(2**40), 2**40, (11,), generator=generator).to(device)),
        ("scale", torch.tensor(0.37, device=device)),
        ("step", torch.tensor(-9, dtype=torch.int64, device=device)),
        ("empty", torch.empty(0, 4, device=device)),
        ("strided", torch.randn(6, 4, generator=generator).to(device).t()),
    ]


def _assert_same(named: list[tuple[str, torch.Tensor]], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in named] == [name for name, _ in expected]
    for (name, tensor), (_, reference) in zip(named, expected):
        assert tensor.dtype == reference.dtype and tensor.shape == reference.shape, name
        assert torch.equal(tensor, reference), name


def test_handle_round_trips_a_cpu_tensor_sharing_its_memory():
    source = torch.arange(12, dtype=torch.float32).view(3, 4)[1:]
    opened = open_handle(tensor_handle(source))
    assert torch.equal(opened, source)
    opened.add_(100)
    assert source[0, 0].item() == 104.0


def test_open_handle_refuses_a_function_that_is_not_a_torch_rebuild():
    with pytest.raises(ValueError, match="posix.system|os.system"):
        open_handle((os.system, ("true",)))
    with pytest.raises(TypeError, match="rebuild_function, args"):
        open_handle("not a handle")


def test_open_handle_refuses_a_storage_handle_that_builds_no_tensor():
    storage_handle = torch.multiprocessing.reductions.rebuild_storage_empty, (torch.UntypedStorage,)
    with pytest.raises(TypeError, match="must rebuild a tensor"):
        open_handle(storage_handle)


def test_bucket_packs_mixed_dtypes_exactly_at_aligned_offsets():
    tensors = _mixed_tensors()
    bucket = pack_bucket(tensors)
    assert bucket.flat.dtype == torch.uint8 and bucket.flat.dim() == 1
    assert [entry[:3] for entry in bucket.entries] == [
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors]
    assert all(offset % BUCKET_ALIGNMENT == 0 for *_, offset in bucket.entries)
    _assert_same(unpack_bucket(bucket.flat, bucket.entries), tensors)


def test_unpack_returns_views_into_the_buffer():
    bucket = pack_bucket(_mixed_tensors())
    start, end = bucket.flat.data_ptr(), bucket.flat.data_ptr() + bucket.flat.numel()
    for name, view in unpack_bucket(bucket.flat, bucket.entries):
        assert view.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr(), name
        assert view.numel() == 0 or start <= view.data_ptr() < end, name  # an empty tensor's data_ptr is 0
    norm = dict(unpack_bucket(bucket.flat, bucket.entries))["norm"]
    norm.fill_(2.0)
    assert torch.equal(dict(unpack_bucket(bucket.flat, bucket.entries))["norm"], torch.full((3,), 2.0).bfloat16())


def test_pack_refuses_tensors_on_two_devices_and_an_empty_list():
    with pytest.raises(ValueError, match="one device.*'b' on meta"):
        pack_bucket([("a", torch.zeros(2)), ("b", torch.zeros(2, device="meta"))])
    with pytest.raises(ValueError, match="at least one"):
        pack_bucket([])


@pytest.mark.parametrize("corrupt, message", [
    (lambda e: e[:3], "must be \\(name, dtype_name, shape, offset_bytes\\)"),
    (lambda e: (7, *e[1:]), "name must be a str"),
    (lambda e: (e[0], "float33", *e[2:]), "dtype_name must name a torch dtype, got 'float33'"),
    (lambda e: (e[0], "Tensor", *e[2:]), "dtype_name must name a torch dtype"),
    (lambda e: (*e[:2], (3, -1), e[3]), "shape must be a sequence of ints >= 0"),
    (lambda e: (*e[:3], e[3] + 4), "multiple of 256"),
    (lambda e: (*e[:3], -256), "offset_bytes must be an int >= 0"),
    (lambda e: (*e[:3], 1 << 20), "spans bytes .* but the buffer holds"),
    (lambda e: (e[0], e[1], (99, 99), e[3]), "spans bytes"),
])
def test_unpack_rejects_corrupted_entries(corrupt, message):
    bucket = pack_bucket(_mixed_tensors())
    entries = [*bucket.entries[:1], corrupt(bucket.entries[1]), *bucket.entries[2:]]
    with pytest.raises(ValueError, match=message):
        unpack_bucket(bucket.flat, entries)


def test_unpack_rejects_overlapping_entries_and_a_buffer_that_is_not_flat_bytes():
    bucket = pack_bucket([("a", torch.zeros(64)), ("b", torch.zeros(64))])
    with pytest.raises(ValueError, match="'a' and 'b' overlap"):
        unpack_bucket(bucket.flat, [bucket.entries[0], (*bucket.entries[1][:3], 0)])
    with pytest.raises(TypeError, match="1-D uint8"):
        unpack_bucket(bucket.flat.view(torch.float32), bucket.entries)


class _RunsShell:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("module, name", [
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "getattr"), ("subprocess", "Popen"),
    ("torch", "load"), ("torch.storage", "_load_from_bytes"), ("torch.storage", "TypedStorage.__init__"),
    ("torch", "__builtins__"),
])
def test_decode_refuses_globals_a_tensor_handle_never_needs(module, name):
    hostile = f"c{module}\n{name}\n(tR.".encode()  # protocol 0: GLOBAL module.name, call it with ()
    with pytest.raises(pickle.UnpicklingError, match="only hold tensor handles"):
        decode_payload(base64.b64encode(hostile).decode())


def test_decode_refuses_a_pickle_that_would_call_os_system(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="system"):
        decode_payload(base64.b64encode(pickle.dumps(_RunsShell(f"touch {marker}"))).decode())
    assert not marker.exists()
    with pytest.raises(ValueError, match="base64"):
        decode_payload("not base64!")


def test_decode_accepts_real_handles_with_dtypes_sizes_and_devices():
    source = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    extras = {"dtype": torch.float16, "size": torch.Size([2, 3]), "device": torch.device("cpu"), "set": {1, 2}}
    decoded = decode_payload(encode_payload({"pairs": [("w", tensor_handle(source))], **extras}))
    assert {key: decoded[key] for key in extras} == extras
    ((name, handle),) = decoded["pairs"]
    opened = open_handle(handle)
    assert name == "w" and torch.equal(opened, source)
    opened.fill_(5)
    assert torch.equal(source, torch.full((2, 3), 5, dtype=torch.bfloat16))


def test_decode_accepts_handles_shared_through_the_file_system_strategy():
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        text = encode_payload([("w", tensor_handle(torch.arange(5.0))), ("none", tensor_handle(torch.empty(0)))])
    finally:
        mp.set_sharing_strategy(previous)
    _assert_same(weights_for_device({"dev": text}, "dev"), [("w", torch.arange(5.0)), ("none", torch.empty(0))])


def _value_forms(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    pairs = [(name, tensor_handle(t)) for name, t in tensors[:3]]
    bucket = pack_bucket(tensors[3:]).payload()
    return {"pairs": pairs, "bucket": bucket, "mixed": [*pairs, bucket]}


@pytest.mark.parametrize("form", ["pairs", "bucket", "mixed"])
@pytest.mark.parametrize("as_text", [False, True], ids=["objects", "base64"])
def test_weights_for_device_opens_every_value_form(form, as_text):
    tensors = _mixed_tensors()
    value = _value_forms(tensors)[form]
    weights = {"GPU-other": [], "GPU-mine": encode_payload(value) if as_text else value}
    expected = {"pairs": tensors[:3], "bucket": tensors[3:], "mixed": tensors}[form]
    _assert_same(weights_for_device(weights, "GPU-mine"), expected)


def test_weights_for_device_names_the_devices_present_when_its_own_is_missing():
    with pytest.raises(ValueError, match=r"device 'GPU-c'; devices present: \['GPU-a', 'GPU-b'\]"):
        weights_for_device({"GPU-b": [], "GPU-a": []}, "GPU-c")


@pytest.mark.parametrize("weights, error, message", [
    ([("w", None)], TypeError, "weights must be a dict"),
    ({"d": 3}, TypeError, r"weights\['d'\] must be a list of \(name, handle\) pairs"),
    ({"d": [("w",)]}, TypeError, r"weights\['d'\]\[0\] must be a \(name, handle\) pair"),
    ({"d": [("w", "handle")]}, TypeError, r"weights\['d'\]\[0\] \('w'\): a tensor handle must be"),
    ({"d": [("w", (print, ()))]}, ValueError, r"weights\['d'\]\[0\] \('w'\).*builtins.print"),
    ({"d": {"entries": []}}, ValueError, r"weights\['d'\] is a dict.*lacks \['bucket'\]"),
    ({"d": [{"bucket": None}]}, ValueError, r"weights\['d'\]\[0\] is a dict.*lacks \['entries'\]"),
])
def test_weights_for_device_names_what_is_wrong_with_the_structure(weights, error, message):
    with pytest.raises(error, match=message):
        weights_for_device(weights, "d")


def _child_adds_one(weights: dict[str, str], device_id: str, device_index: int | None) -> None:
    for _, tensor in weights_for_device(weights, device_id, device_index):
        tensor.add_(1)
    if device_index is not None:
        torch.cuda.synchronize()


def _shared_with_a_spawned_child(device: str, device_index: int | None) -> None:
    """The child, a separate process, opens the payload and writes into it; the parent sees the writes."""
    tensors = _mixed_tensors(device)[:4]
    single, bucket = tensors[0][1], pack_bucket(tensors[1:])
    weights = {"dev": encode_payload([("embed", tensor_handle(single)), bucket.payload()])}
    expected = [(name, t + 1) for name, t in tensors]
    child = mp.get_context("spawn").Process(target=_child_adds_one, args=(weights, "dev", device_index))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    _assert_same([("embed", single), *unpack_bucket(bucket.flat, bucket.entries)], expected)


def test_a_spawned_process_writes_into_shared_cpu_weights():
    _shared_with_a_spawned_child("cpu", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_spawned_process_writes_into_cuda_weights_through_ipc():
    _shared_with_a_spawned_child("cuda", torch.cuda.current_device())
