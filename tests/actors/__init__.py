"""Helpers shared by the actor tests."""


class IdleEngine:
    """Just enough of an engine for the engine loop to take calls: never any work, nothing to drain."""

    has_work = False
    weight_version = 0

    def drain(self):
        return None

    def take_control_deltas(self):
        return []
