"""Placement: caller bundles validated and used exactly; owned groups created and removed."""

from __future__ import annotations

import pytest

from raylm.placement import resolve_placement
from tests.conftest import cluster_placement_groups


@pytest.fixture(scope="module")
def groups(ray_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    cpu = placement_group([{"CPU": 1}] * 3)
    gpu_less = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray_cluster.get([cpu.ready(), gpu_less.ready()])
    yield cpu, gpu_less
    remove_placement_group(cpu)
    remove_placement_group(gpu_less)


def test_caller_bundles_are_used_in_the_given_order(groups):
    cpu, other = groups
    placement = resolve_placement(3, False, [cpu, other], [[2, 0], [1]])
    assert placement.bundles == [(cpu, 2), (cpu, 0), (other, 1)]
    assert placement.owned_groups == []


@pytest.mark.parametrize(
    ("world", "indices", "match"),
    [
        (2, [[0, 1], [0]], "one list of bundle indices per group"),
        (2, [[1, 1]], "repeats a bundle"),
        (2, [[0, 5]], "out of range"),
        (3, [[0, 1]], "give 2 ranks but"),
    ],
)
def test_bad_caller_bundles_are_clear_errors(groups, world, indices, match):
    with pytest.raises(ValueError, match=match):
        resolve_placement(world, False, [groups[0]], indices)


def test_bundle_without_a_gpu_is_rejected_for_gpu_workers(groups):
    with pytest.raises(ValueError, match="lacks GPU"):
        resolve_placement(1, True, [groups[0]], [[0]], per_worker_gpu_share=0.5)


@pytest.mark.parametrize("share", [0.0, 1.5, -1.0])
def test_gpu_share_must_be_in_zero_one(groups, share):
    with pytest.raises(ValueError, match=r"per_worker_gpu_share must be in \(0, 1\]"):
        resolve_placement(1, True, None, None, per_worker_gpu_share=share)


def test_owned_group_is_created_packed_and_removed(ray_cluster):
    placement = resolve_placement(2, False)
    [group] = placement.owned_groups
    assert placement.bundles == [(group, 0), (group, 1)]
    assert group.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
    placement.remove_owned()
    states = [g.state for g in cluster_placement_groups() if g.placement_group_id == group.id.hex()]
    assert states == ["REMOVED"]
