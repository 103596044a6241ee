"""The Ray Serve app with ingress 'engine': each engine replica serves the HTTP app itself, so a request goes from
Serve's proxy (or HAProxy, http_proxy 'haproxy') to the engine's process with no ingress deployment between them;
answers equal the engine's own."""

from __future__ import annotations

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raylm import LLM, SamplingParams
from raylm.serving.config import ServeArgs
from tests.serving.conftest import free_port, listening_processes, openai_client, ray_served

PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=["serve", "haproxy"])
def config(request, tiny_model_dirs) -> ServeArgs:
    return ServeArgs(model=str(tiny_model_dirs["llama"]), served_model_name="tiny", host="127.0.0.1",
                     port=free_port(), ingress="engine", http_proxy=request.param, max_seq_len=256,
                     max_batch_size=4, kv_cache_config={"max_tokens": 2048})


@pytest.fixture(scope="module")
def base_url(config):
    with ray_served(config, num_cpus=4) as url:
        yield url


@pytest.mark.slow  # a Ray cluster and Serve take well over 30 s to start on the CI machine
def test_the_engine_replica_answers_http_itself_as_the_engine_does(base_url, config):
    from ray import serve

    client = openai_client(base_url)
    greedy = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**greedy).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **greedy)
                       if chunk.choices)
    with LLM(**{**config.llm_kwargs(), "executor": "local"}) as llm:
        expected = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert whole == streamed == expected.outputs[0].text
    assert [model.id for model in client.models.list()] == ["tiny"]
    deployments = serve.status().applications["raylm"].deployments
    assert set(deployments) == {"RaylmServer"}  # no ingress deployment in front of the engine
    families = {family.name: family for family in text_string_to_metric_families(
        httpx2.get(f"{base_url}/prometheus/metrics", timeout=30).text)}
    hops = {sample.labels["hop"]: sample.value for sample in families["raylm_request_hop_seconds"].samples
            if sample.name.endswith("_count")}
    assert hops.get("to_engine", 0) >= 2 and hops.get("from_engine", 0) == 0  # nothing crossed between replicas
    listeners = listening_processes(config.port)
    assert listeners == {"haproxy"} if config.http_proxy == "haproxy" else "haproxy" not in listeners


def test_ingress_engine_serves_one_model_routed_by_serves_proxy(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match="ingress 'engine' serves one model"):
        ServeArgs(ingress="engine", models=[{"model": model, "served_model_name": "a"},
                                            {"model": model, "served_model_name": "b"}])
    with pytest.raises(ValueError, match="prefix_aware"):
        ServeArgs(model=model, ingress="engine", num_replicas=2, request_router="prefix_aware")
    assert ServeArgs(model=model, ingress="engine", num_replicas=2).ingress == "engine"


def test_ingress_replicas_sets_the_ingress_deployment_apart_from_the_engines(tiny_model_dirs):
    """ingress_replicas: replicas of the ingress deployment in front of the engines (default: as many as the
    engine deployment); refused with ingress 'engine', which has none."""
    from raylm.serving.ray_serve import build_openai_app

    model = str(tiny_model_dirs["llama"])

    def ingress_replicas(**fields) -> int:
        return build_openai_app(ServeArgs(model=model, **fields))._bound_deployment.num_replicas

    assert ingress_replicas(ingress_replicas=3) == 3
    assert ingress_replicas(num_replicas=2) == 2
    assert ingress_replicas(num_replicas=2, ingress_replicas=1) == 1
    with pytest.raises(ValueError, match="ingress_replicas counts the replicas of the ingress deployment"):
        ServeArgs(model=model, ingress="engine", ingress_replicas=2)
    with pytest.raises(ValueError, match="ingress_replicas"):
        ServeArgs(model=model, ingress_replicas=0)


def test_auto_puts_the_app_on_the_engine_replica_for_one_model_on_one_replica(tiny_model_dirs):
    """ingress 'auto': the app on the engine replica, the faster layout for one replica behind HAProxy
    (docs/benchmarks.md); the ingress deployment where a server routes across replicas or fronts several models."""
    from raylm.serving.ray_serve import build_openai_app

    model = str(tiny_model_dirs["llama"])

    def layout(**fields) -> str:
        return ServeArgs(model=model, **{"ingress": "auto", **fields}).ingress_layout

    assert ServeArgs(model=model).ingress == "auto" and layout() == "engine"  # the default
    assert layout(autoscaling_config={"min_replicas": 1, "max_replicas": 1}) == "engine"
    assert layout(num_replicas=2) == layout(autoscaling_config={"min_replicas": 1, "max_replicas": 2}) == "deployment"
    assert layout(ingress_replicas=1) == layout(request_router="prefix_aware") == "deployment"
    assert layout(ingress="deployment") == "deployment" and layout(ingress="engine", num_replicas=2) == "engine"
    assert ServeArgs(ingress="auto", models=[{"model": model, "served_model_name": "a"}]).ingress_layout == "engine"
    two = [{"model": model, "served_model_name": "a"}, {"model": model, "served_model_name": "b"}]
    assert ServeArgs(ingress="auto", models=two).ingress_layout == "deployment"
    assert build_openai_app(ServeArgs(model=model, ingress="auto"))._bound_deployment.name == "RaylmServer"
    assert build_openai_app(ServeArgs(model=model, ingress="auto", num_replicas=2))._bound_deployment.name == \
        "OpenAIIngress"
