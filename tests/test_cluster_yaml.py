"""cluster.yaml passes the Ray cluster launcher's own checks (`ray up` fills in the provider's defaults, then
validates against the autoscaler's schema; neither step calls the cloud), and a field the launcher does not know
fails them."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _check(config: dict) -> dict:
    """What `ray up` does to a config before it calls the cloud: defaults filled in, then validated."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_the_launchers_validation_with_a_cpu_head_and_autoscaling_gpu_workers():
    config = _check(_load())
    assert config["provider"]["type"] == "aws"
    nodes = config["available_node_types"]
    head = nodes[config["head_node_type"]]
    workers = [node for name, node in nodes.items() if name != config["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and "--num-gpus=0" in " ".join(config["head_start_ray_commands"])
    assert workers and all(node["resources"]["GPU"] >= 1 for node in workers)
    assert all(node["min_workers"] < node["max_workers"] <= config["max_workers"] for node in workers)
    setup = " ".join(config["setup_commands"])
    assert "raylm[serve,batch,gpu]" in setup
    assert any("boto3" in command for command in config["head_setup_commands"])  # Ray's default, kept
    assert "$RAY_HEAD_IP:6379" in " ".join(config["worker_start_ray_commands"])


@pytest.mark.parametrize("break_it", [
    lambda config: config.update(max_worker=4),                                    # a top-level typo
    lambda config: config["available_node_types"]["gpu_worker"].update(min_worker=1),  # a node type's typo
    lambda config: config["docker"].update(imag="rayproject/ray"),                  # docker's typo
    lambda config: config["available_node_types"]["gpu_worker"]["resources"].update(GPU=0.5),  # not an integer
], ids=["top-level", "node-type", "docker", "resources"])
def test_an_unknown_or_malformed_field_fails_the_validation(break_it):
    config = _load()
    break_it(config)
    with pytest.raises(jsonschema.ValidationError):
        _check(config)


def test_a_head_node_type_that_is_not_defined_fails_the_validation():
    config = _load()
    config["head_node_type"] = "heads"
    with pytest.raises(ValueError, match="head_node_type"):
        _check(config)
