"""The Ray Serve app's configuration, without a cluster: deploy/ray-serve.yaml is a valid Serve
config (Ray's own ServeDeploySchema) whose app_builder args build the application, and
`pagoda serve --ray`'s flags become the deployment's replicas, router and SLO autoscaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from pagoda.cli import build_parser, ray_options
from pagoda.scaleout.autoscaling import SLOPolicyConfig
from pagoda.scaleout.ray_serve import RayServeOptions, _scaling, app_builder

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray-serve.yaml"


def test_the_serve_config_file_validates_and_builds() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "pagoda.scaleout.ray_serve:app_builder"
    assert isinstance(app_builder(app.args), serve.Application)
    scaling = _scaling(
        RayServeOptions(
            min_replicas=app.args["min_replicas"],
            max_replicas=app.args["max_replicas"],
            slo=SLOPolicyConfig(**app.args["slo"]),
        )
    )["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    assert scaling.policy.policy_function == ("pagoda.scaleout.autoscaling:SLOAutoscalingPolicy")
    assert scaling.policy.policy_kwargs["ttft_slo_s"] == 1.0


def test_app_builder_refuses_unknown_args() -> None:
    with pytest.raises(TypeError):
        app_builder({"replicas": 2})
    with pytest.raises(ValueError, match="min_replicas"):
        app_builder({"min_replicas": 3, "max_replicas": 1})


def parse(*flags: str) -> RayServeOptions:
    args = build_parser().parse_args(["serve", "--ray", *flags])
    options = ray_options(args)
    assert isinstance(options, RayServeOptions)
    return options


def test_serve_ray_flags() -> None:
    assert (parse().min_replicas, parse().max_replicas) == (1, 1)
    fixed = parse("--num-replicas", "3")
    assert (fixed.min_replicas, fixed.max_replicas, fixed.autoscaling) == (3, 3, False)
    auto = parse("--min-replicas", "1", "--max-replicas", "4", "--ttft-slo", "0.5")
    assert (auto.min_replicas, auto.max_replicas, auto.autoscaling) == (1, 4, True)
    assert auto.slo.ttft_slo_s == 0.5 and auto.slo.tpot_slo_s == 0.1
    assert parse("--ray-router", "power-of-two").router == "power-of-two"
    assert parse("--replica-num-gpus", "1").replica_num_gpus == 1.0
    assert "num_replicas" in _scaling(fixed) and "autoscaling_config" in _scaling(auto)
    with pytest.raises(ValueError, match="not both"):
        parse("--num-replicas", "2", "--max-replicas", "4")
    with pytest.raises(ValueError, match="min_replicas"):
        parse("--min-replicas", "3", "--max-replicas", "2")
