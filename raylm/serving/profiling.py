"""/start_profile and /stop_profile: a torch.profiler window over this process, written as a chrome trace.

The routes exist only when the server's config enables them (enable_profiling_endpoints). Traces go under the
server's profile_dir; a request may name a sub-folder of it, never a path outside it. The profiler records every
thread of the process, so with the in-process engine it captures the engine loop as well as the server. One
window at a time: a second start, or a stop without a start, is a conflict.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path, PurePath
from typing import Literal

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from torch._C._profiler import _ExperimentalConfig

from raylm.serving.errors import bad_request
from raylm.serving.protocol import RequestModel, reject_unsupported


class StartProfileRequest(RequestModel):
    """The body of /start_profile; every field is optional."""

    output_dir: str | None = None  # a sub-folder of the server's profile_dir
    activities: list[Literal["CPU", "GPU", "CUDA_PROFILER"]] | None = None
    num_steps: int | None = None
    start_step: int | None = None

    # Iteration-scoped windows need the engine loop to count steps for the profiler, which it does not yet.
    _unsupported = reject_unsupported("num_steps", "start_step")


class ProfileConflict(Exception):
    """A window is already open (on start) or none is (on stop)."""


class TorchProfiler:
    def __init__(self, profile_dir: str):
        self.profile_dir = Path(profile_dir)
        self._profiler: torch.profiler.profile | None = None
        self._trace_path: str | None = None
        self._lock = asyncio.Lock()

    async def start(self, request: StartProfileRequest) -> str:
        """Opens a window; returns the path its trace will be written to."""
        async with self._lock:
            if self._profiler is not None:
                raise ProfileConflict(f"a profile window is already active (trace {self._trace_path})")
            activities = self._activities(request.activities or ["CPU", "GPU"], explicit=bool(request.activities))
            output_dir = self._output_dir(request.output_dir)
            try:
                os.makedirs(output_dir, exist_ok=True)
            except OSError as exc:
                raise bad_request(f"output_dir {request.output_dir!r} cannot be created under the server's "
                                  f"profile directory: {exc.strerror}", "output_dir") from exc
            profile_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            profiler = torch.profiler.profile(activities=activities,
                                              experimental_config=_ExperimentalConfig(profile_all_threads=True))
            profiler.start()  # on the event loop's thread, where stop() runs too
            self._profiler = profiler
            self._trace_path = os.path.join(output_dir, f"raylm-trace-{profile_id}-rank-0.json")
            return self._trace_path

    async def stop(self) -> str:
        """Closes the window and returns once its chrome trace is on disk; returns the trace's path."""
        async with self._lock:
            if self._profiler is None:
                raise ProfileConflict("no profile window is active; call /start_profile first")
            profiler, path = self._profiler, self._trace_path
            self._profiler, self._trace_path = None, None
            profiler.stop()
            await asyncio.to_thread(profiler.export_chrome_trace, path)
            return path

    def _output_dir(self, requested: str | None) -> str:
        """profile_dir, or the sub-folder of it that the request names; 400 for a path that leaves it."""
        if not requested:
            return str(self.profile_dir)
        relative = PurePath(requested)
        root = self.profile_dir.resolve()
        target = (root / relative).resolve()
        if relative.is_absolute() or ".." in relative.parts or not target.is_relative_to(root):
            raise bad_request(f"output_dir must be a sub-folder of the server's profile directory, relative and "
                              f"without '..', got {requested!r}", "output_dir")
        return str(target)

    @staticmethod
    def _activities(names: list[str], explicit: bool) -> list[torch.profiler.ProfilerActivity]:
        if "CUDA_PROFILER" in names:
            raise bad_request("raylm does not support the CUDA_PROFILER activity yet", "activities",
                              "unsupported_parameter")
        activities = []
        if "CPU" in names:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if "GPU" in names:
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            elif explicit:
                raise bad_request("activities asks for GPU but this server has no CUDA device", "activities")
        return activities


def add_profiling_routes(app: FastAPI, profile_dir: str) -> None:
    """Adds /start_profile and /stop_profile to app, writing traces under profile_dir."""
    profiler = TorchProfiler(profile_dir)

    @app.post("/start_profile")
    async def start_profile(body: StartProfileRequest | None = None) -> Response:
        try:
            path = await profiler.start(body or StartProfileRequest())
        except ProfileConflict as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=409)
        return JSONResponse({"message": "Profiling started", "trace_path": path})

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        try:
            path = await profiler.stop()
        except ProfileConflict as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=409)
        return JSONResponse({"message": "Profiling stopped", "trace_path": path})
