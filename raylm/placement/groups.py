"""Placement groups: one bundle per rank, created by raylm or given by the caller.

By default an engine creates one PACK placement group with a bundle per rank and removes it at shutdown.
A caller (an RL trainer, say) may pass its own placement groups and, for each, the bundle indices the
engine's ranks take, in rank order; those are used exactly as given and never removed by raylm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RankPlacement:
    """Where each rank runs: (placement group, bundle index) per rank, and whether raylm owns the groups."""

    bundles: list[tuple[Any, int]]
    owned_groups: list[Any]
    gpu_share: float  # GPUs each worker actor asks for (0 on the CPU)

    def remove_owned(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.owned_groups:
            remove_placement_group(group)
        self.owned_groups = []


def _validate_caller_groups(placement_groups: list, bundle_indices: list[list[int]] | None, world_size: int,
                            needed: dict[str, float]) -> list[tuple[Any, int]]:
    if bundle_indices is None:
        bundle_indices = [list(range(len(group.bundle_specs))) for group in placement_groups]
    if len(bundle_indices) != len(placement_groups):
        raise ValueError(f"placement_bundle_indices has {len(bundle_indices)} lists but placement_groups has "
                         f"{len(placement_groups)} groups; give one list of bundle indices per group")
    bundles: list[tuple[Any, int]] = []
    for group, indices in zip(placement_groups, bundle_indices):
        specs = group.bundle_specs
        if len(set(indices)) != len(indices):
            raise ValueError(f"placement_bundle_indices {indices} repeats a bundle; each rank needs its own bundle")
        for index in indices:
            if not 0 <= index < len(specs):
                raise ValueError(f"bundle index {index} is out of range for a placement group of "
                                 f"{len(specs)} bundles")
            for resource, amount in needed.items():
                if specs[index].get(resource, 0) < amount:
                    raise ValueError(f"bundle {index} {specs[index]} lacks {resource}: each rank needs {amount}")
            bundles.append((group, index))
    if len(bundles) != world_size:
        raise ValueError(f"the placement bundles give {len(bundles)} ranks but tensor_parallel_size x "
                         f"pipeline_parallel_size is {world_size}")
    return bundles


def resolve_placement(world_size: int, use_gpu: bool, placement_groups: list | None = None,
                      placement_bundle_indices: list[list[int]] | None = None,
                      per_worker_gpu_share: float | None = None, timeout_s: float = 120.0) -> RankPlacement:
    """Bundles for every rank: the caller's, validated, or a new PACK placement group."""
    import ray
    from ray.util.placement_group import placement_group

    share = per_worker_gpu_share if per_worker_gpu_share is not None else 1.0
    if not 0.0 < share <= 1.0:
        raise ValueError(f"per_worker_gpu_share must be in (0, 1], got {share}")
    gpu_share = share if use_gpu else 0.0
    needed = {"GPU": gpu_share} if use_gpu else {"CPU": 1.0}
    if placement_groups:
        bundles = _validate_caller_groups(list(placement_groups), placement_bundle_indices, world_size, needed)
        return RankPlacement(bundles, [], gpu_share)
    if placement_bundle_indices is not None:
        raise ValueError("placement_bundle_indices needs placement_groups")
    bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not place {world_size} bundles of {bundle} within {timeout_s} s")
    return RankPlacement([(group, index) for index in range(world_size)], [group], gpu_share)
