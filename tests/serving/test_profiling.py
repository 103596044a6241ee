"""The profiling window: off unless the config enables it, writing chrome traces only under the server's
profile_dir (a request names at most a sub-folder of it), one window at a time."""

from __future__ import annotations

import json

import httpx2
import pytest

from raylm.serving import LocalEngine, ServingConfig, build_app
from tests.serving.conftest import MODEL, openai_client, serve


def _config(**options) -> ServingConfig:
    return ServingConfig(served_model_name=MODEL, **options)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def profiling_url(llm, profile_dir):
    app = build_app(LocalEngine(llm), _config(enable_profiling_endpoints=True, profile_dir=str(profile_dir)))
    with serve(app) as url:
        yield url


def _start(base_url: str, body: dict | None = None) -> httpx2.Response:
    return httpx2.post(f"{base_url}/start_profile", json=body or {}, timeout=60)


def test_the_profiling_routes_are_off_unless_enabled(llm, tmp_path):
    assert _config().enable_profiling_endpoints is False
    with serve(build_app(LocalEngine(llm), _config(profile_dir=str(tmp_path)))) as base_url:
        for route in ("/start_profile", "/stop_profile"):
            response = httpx2.post(f"{base_url}{route}", json={})
            assert response.status_code == 404 and set(response.json()["error"]) >= {"message", "type"}
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("output_dir", ["/tmp/elsewhere", "../escaped", "inside/../../escaped", "..", "sub/.."])
def test_an_output_dir_outside_the_profile_dir_is_a_400_and_creates_nothing(profiling_url, profile_dir, output_dir):
    response = _start(profiling_url, {"output_dir": output_dir})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "output_dir" and "sub-folder of the server's profile directory" in error["message"]
    assert not (profile_dir.parent / "escaped").exists() and not any(profile_dir.iterdir())


def test_an_output_dir_through_a_link_out_of_the_profile_dir_is_a_400(profiling_url, profile_dir, tmp_path):
    link = profile_dir / "link"
    link.symlink_to(tmp_path, target_is_directory=True)
    try:
        assert _start(profiling_url, {"output_dir": "link/traces"}).status_code == 400
        assert not (tmp_path / "traces").exists()
    finally:
        link.unlink()


def test_a_window_writes_its_trace_in_the_named_sub_folder_and_rejects_overlaps(llm, profiling_url, profile_dir):
    started = _start(profiling_url, {"output_dir": "run-1/rank-0"})
    assert started.status_code == 200 and started.json()["message"] == "Profiling started"
    again = _start(profiling_url)
    assert again.status_code == 409 and again.json()["success"] is False
    openai_client(profiling_url).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    stopped = httpx2.post(f"{profiling_url}/stop_profile", timeout=60)
    assert stopped.status_code == 200
    trace_path = stopped.json()["trace_path"]
    assert trace_path.startswith(str((profile_dir / "run-1" / "rank-0").resolve()))
    assert trace_path.endswith("-rank-0.json")
    with open(trace_path) as handle:
        names = {event.get("name") for event in json.load(handle)["traceEvents"]}
    assert "aten::linear" in names  # the engine thread's forward pass was captured
    assert httpx2.post(f"{profiling_url}/stop_profile").status_code == 409
    unsupported = _start(profiling_url, {"num_steps": 3})
    assert unsupported.status_code == 400 and unsupported.json()["error"]["param"] == "num_steps"


def test_without_an_output_dir_the_trace_goes_to_the_profile_dir(profiling_url, profile_dir):
    assert _start(profiling_url).status_code == 200
    trace_path = httpx2.post(f"{profiling_url}/stop_profile", timeout=60).json()["trace_path"]
    assert str(profile_dir.resolve()) in trace_path and (profile_dir / trace_path.rsplit("/", 1)[1]).exists()
