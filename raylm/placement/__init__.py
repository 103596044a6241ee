"""Placement of an engine's workers: one bundle of a Ray placement group per rank."""

from raylm.placement.groups import RankPlacement, resolve_placement

__all__ = ["RankPlacement", "resolve_placement"]
