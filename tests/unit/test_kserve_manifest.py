"""deploy/kserve: each InferenceService manifest is one that KServe's own model classes (the
`kserve` package) and the Kubernetes client's deserializer accept, with no field they would drop,
and its container runs `pagoda serve` with flags that pagoda's CLI parses, the port that the
probes, the Service and the Prometheus annotations use, and a grace period that covers the drain.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kserve
import kubernetes.client
import pytest
import yaml
from kserve import V1beta1InferenceService
from kserve.constants import constants
from kubernetes.utils import parse_quantity

from pagoda.cli import build_parser
from pagoda.server.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kserve"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))

_K8S = kubernetes.client.ApiClient()
_PRIMITIVES: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "int": int,
    "bool": bool,
    "float": (int, float),
    "object": object,
}
# kserve's generated models name these int-or-string quantity types, but neither kserve.models
# nor kubernetes.client.models defines them (kserve/kserve#6168): they stay as written.
_QUANTITIES = {"V1beta1MetricQuantity", "ResourceQuantity"}


def build(data: Any, klass: str | type, path: str = "") -> Any:
    """The model object that `data` (parsed YAML) makes as a `klass`, a kserve model class or a
    type as kserve's models name them ('V1Container', 'list[...]', 'dict(str, ...)').

    kserve's own ApiClient looks up type names in kserve.models only, so it cannot build the
    Kubernetes types inside an InferenceService (kserve/kserve#2329): kserve's models are built
    here from their openapi_types, and each Kubernetes type is handed to the Kubernetes client's
    deserializer (pydantic models with strict types)."""
    if isinstance(klass, str):
        if m := re.fullmatch(r"list\[(.+)\]", klass):
            assert isinstance(data, list), f"{path}: a list, not {data!r}"
            return [build(v, m[1], f"{path}[{i}]") for i, v in enumerate(data)]
        if m := re.fullmatch(r"dict\(str, (.+)\)", klass):
            assert isinstance(data, dict), f"{path}: a mapping, not {data!r}"
            return {k: build(v, m[1], f"{path}.{k}") for k, v in data.items()}
        if klass in _PRIMITIVES:
            ok = isinstance(data, _PRIMITIVES[klass]) and not (
                klass == "int" and isinstance(data, bool)
            )
            assert ok, f"{path}: {data!r} is not a {klass}"
            return data
        if klass in _QUANTITIES:
            assert isinstance(data, (int, str)), f"{path}: {data!r} is not a quantity"
            return data
        if not hasattr(kserve.models, klass):
            return _K8S.deserialize(json.dumps(data), klass, "application/json")
        klass = getattr(kserve.models, klass)
    model: Any = klass
    assert isinstance(data, dict), f"{path}: a {model.__name__} mapping, not {data!r}"
    kwargs = {
        attr: build(data[key], model.openapi_types[attr], f"{path}.{key}")
        for attr, key in model.attribute_map.items()
        if key in data
    }
    return model(**kwargs)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two parsed YAML/JSON documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for key in sorted(a.keys() | b.keys())
            for d in differences(a.get(key), b.get(key), f"{path}.{key}")
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if a == b and type(a) is type(b):
        return []
    return [f"{path}: {a!r} != {b!r}"]


def load(data: dict[str, Any]) -> V1beta1InferenceService:
    """The InferenceService that the manifest `data` makes. The deserializers drop fields they do
    not know, so what it serializes back to must be the manifest itself: a misspelt or misplaced
    field fails here rather than vanishing."""
    isvc = build(data, V1beta1InferenceService)
    back = kserve.ApiClient().sanitize_for_serialization(isvc)
    diff = differences(data, back)
    assert not diff, "fields that KServe's types do not take:\n" + "\n".join(diff)
    return isvc


@pytest.fixture(params=MANIFESTS, ids=lambda p: p.name)
def manifest(request: pytest.FixtureRequest) -> dict[str, Any]:
    data = yaml.safe_load(request.param.read_text())
    assert isinstance(data, dict)
    return data


def test_both_manifests_are_checked() -> None:
    assert [p.name for p in MANIFESTS] == ["inferenceservice-gpu.yaml", "inferenceservice.yaml"]


def container_args(isvc: V1beta1InferenceService) -> tuple[Any, Any]:
    (container,) = isvc.spec.predictor.containers
    assert container.name == "kserve-container"  # the predictor's main container, to KServe
    assert container.command == ["pagoda"]
    args = build_parser().parse_args(container.args)
    assert args.command == "serve"
    return container, args


def test_manifest_is_an_inference_service(manifest: dict[str, Any]) -> None:
    isvc = load(manifest)
    assert isvc.api_version == constants.KSERVE_V1BETA1 == "serving.kserve.io/v1beta1"
    assert isvc.kind == constants.KSERVE_KIND_INFERENCESERVICE
    assert isvc.metadata.annotations["serving.kserve.io/deploymentMode"] == "Standard"
    assert isvc.spec.transformer is None and isvc.spec.explainer is None


def test_container_runs_pagoda_serve_on_its_port(manifest: dict[str, Any]) -> None:
    isvc = load(manifest)
    container, args = container_args(isvc)
    assert container.image.startswith("ghcr.io/pagoda-llm/pagoda:")
    assert args.host == "0.0.0.0"
    (port,) = container.ports
    assert port.container_port == args.port == 8080 and port.protocol == "TCP"
    probes = [container.startup_probe, container.readiness_probe, container.liveness_probe]
    for probe in probes:
        assert (probe.http_get.path, probe.http_get.port) == ("/health", args.port)
    # Liveness waits for the startup probe, which allows minutes for the model to load.
    assert container.startup_probe.period_seconds * container.startup_probe.failure_threshold >= 300

    predictor = isvc.spec.predictor
    pod = predictor.annotations
    assert (pod["prometheus.io/scrape"], pod["prometheus.io/path"]) == ("true", "/metrics")
    assert pod["prometheus.io/port"] == str(args.port)
    meta = isvc.metadata.annotations
    assert meta["serving.kserve.io/enable-prometheus-scraping"] == "true"
    assert meta["prometheus.kserve.io/port"] == str(args.port)
    assert meta["prometheus.kserve.io/path"] == "/metrics"


def test_grace_period_covers_the_drain(manifest: dict[str, Any]) -> None:
    isvc = load(manifest)
    container, args = container_args(isvc)
    command = container.lifecycle.pre_stop._exec.command
    assert command[0] == "sleep"
    # the preStop sleep, then SIGTERM: pagoda drains for --shutdown-timeout (30 s by default)
    # and stops; the kubelet's SIGKILL comes terminationGracePeriodSeconds after the preStop.
    drain = int(command[1]) + args.shutdown_timeout
    assert isvc.spec.predictor.termination_grace_period_seconds >= drain + 10


def test_resources(manifest: dict[str, Any]) -> None:
    isvc = load(manifest)
    container, args = container_args(isvc)
    requests, limits = container.resources.requests, container.resources.limits
    assert {"cpu", "memory"} <= requests.keys() and limits.keys() == requests.keys()
    for name in requests:
        assert parse_quantity(requests[name]) <= parse_quantity(limits[name])
    threads = {e.name: e.value for e in container.env or []}.get("OMP_NUM_THREADS")
    if threads is not None:
        assert int(threads) <= parse_quantity(limits["cpu"])
    gpus = limits.get("nvidia.com/gpu")
    if gpus is None:
        assert args.device in ("auto", "cpu")
    else:
        assert requests["nvidia.com/gpu"] == gpus == "1"
        assert args.device == "cuda" and container.image.endswith("-cuda")


def pagoda_metric_names() -> set[str]:
    families = list(Metrics("m").registry.collect())
    return {f.name for f in families} | {s.name for f in families for s in f.samples}


def test_autoscaling(manifest: dict[str, Any]) -> None:
    isvc = load(manifest)
    predictor = isvc.spec.predictor
    assert 1 <= predictor.min_replicas <= predictor.max_replicas
    autoscaler = isvc.metadata.annotations["serving.kserve.io/autoscalerClass"]
    if autoscaler == "hpa":
        assert predictor.scale_metric in ("cpu", "memory") and 0 < predictor.scale_target <= 100
        assert predictor.auto_scaling is None
    else:
        assert autoscaler == "keda" and predictor.scale_metric is None
        (metric,) = predictor.auto_scaling.metrics
        assert metric.type == "External" and metric.external.metric.backend == "prometheus"
        names = re.findall(r"pagoda:\w+", metric.external.metric.query)
        assert names and set(names) <= pagoda_metric_names()
        assert metric.external.target.type == "Value" and int(metric.external.target.value) > 0


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.__setitem__("readinesProbe", c.pop("readinessProbe")),  # a typo
        lambda c: c["ports"][0].__setitem__("containerPort", "8080"),  # a string, not a number
        lambda c: c["livenessProbe"]["httpGet"].__setitem__("paht", "/health"),
        lambda c: c["args"].append(8080),
    ],
    ids=["unknown-field", "wrong-type", "nested-unknown-field", "non-string-arg"],
)
def test_load_refuses_what_kserve_would_not_take(edit: Any) -> None:
    data = yaml.safe_load((DEPLOY / "inferenceservice.yaml").read_text())
    bad = copy.deepcopy(data)
    edit(bad["spec"]["predictor"]["containers"][0])
    with pytest.raises((AssertionError, ValueError)):
        load(bad)
    bad = copy.deepcopy(data)
    bad["spec"]["predictor"]["scaleTargets"] = bad["spec"]["predictor"].pop("scaleTarget")
    with pytest.raises(AssertionError, match="scaleTargets"):
        load(bad)


def test_dockerfile_entry_point_serves_on_the_manifests_port() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    directives = dict(re.findall(r"^(ENTRYPOINT|CMD|EXPOSE) (.+)$", text, re.MULTILINE))
    entrypoint, cmd = json.loads(directives["ENTRYPOINT"]), json.loads(directives["CMD"])
    assert entrypoint == ["pagoda", "serve"]
    args = build_parser().parse_args(entrypoint[1:] + cmd)
    assert (args.host, args.port, int(directives["EXPOSE"])) == ("0.0.0.0", 8080, 8080)
    assert re.search(r"^FROM python:3\.11-slim$", text, re.MULTILINE)
