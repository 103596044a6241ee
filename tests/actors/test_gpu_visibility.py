"""Which CUDA device a Ray worker computes on when every GPU of its node is visible to it."""

from __future__ import annotations

import pytest

from raylm.actors.ray_worker import cuda_index


def test_cuda_index_is_ray_gpu_id_when_the_node_shows_every_gpu():
    assert cuda_index("3", None) == 3
    assert cuda_index("0", "") == 0


def test_cuda_index_follows_the_node_cuda_visible_devices():
    assert cuda_index("6", "4,5,6,7") == 2
    assert cuda_index("5", "7, 5") == 1


def test_cuda_index_refuses_a_gpu_the_process_cannot_see():
    with pytest.raises(RuntimeError, match="GPU 2 assigned by Ray"):
        cuda_index("2", "0,1")
