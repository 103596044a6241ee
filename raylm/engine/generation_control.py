"""Pausing and resuming generation (pause_generation / resume_generation), the same for every engine core: a
paused core runs no steps; pausing with `abort` ends every request it holds, and the deltas of those aborts wait
for the driver in take_control_deltas."""

from __future__ import annotations

from raylm.engine.messages import RequestDelta


class GenerationControl:
    """Mixed into an engine core, which sets `paused = False` and `_control_deltas = []` and provides
    `request_ids` and `abort_request`."""

    paused: bool
    _control_deltas: list[RequestDelta]

    def request_ids(self) -> list[str]:
        raise NotImplementedError

    def abort_request(self, request_id: str, error: str | None = None,
                      reason: str | None = None) -> RequestDelta | None:
        raise NotImplementedError

    def pause(self, abort: bool) -> int:
        """Stops running steps until resume_generation. With `abort`, every request ends now (finish_reason
        "abort", stop_reason "generation paused"). Returns how many requests were aborted."""
        self.paused = True
        if not abort:
            return 0
        aborted = [delta for request_id in self.request_ids()
                   if (delta := self.abort_request(request_id, reason="generation paused")) is not None]
        self._control_deltas.extend(aborted)
        return len(aborted)

    def resume_generation(self) -> None:
        self.paused = False

    def take_control_deltas(self) -> list[RequestDelta]:
        """Deltas that control calls produced (pause's aborts), for the driver."""
        deltas, self._control_deltas = self._control_deltas, []
        return deltas
