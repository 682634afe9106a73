"""deploy/kubernetes: every kustomization renders, every object is schema-valid, and the
objects agree with each other and with pdproxy (probes, ports, drain, registration)."""

from __future__ import annotations

import copy
import json
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from engines import register

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]
from pdproxy.api.info import router
from tests.deploy.conftest import DEPLOYABLE, TARGETS
from tests.deploy.manifests import (
    DEPLOY,
    K8S_VERSION,
    container_env,
    containers,
    expand,
    is_pdproxy,
    is_register,
    named,
    of_kind,
    pod_specs,
)

# Objects of CRDs have no bundled schema; they are checked by hand below.
CRD_GROUPS = ("monitoring.coreos.com/",)
UVICORN_SHUTDOWN_SECS = 5  # pdproxy/cli/main.py: timeout_graceful_shutdown after the drain


def pdproxy_deployment(objects) -> dict[str, Any]:
    return named(objects, "Deployment", "pdproxy")


def pdproxy_container(objects) -> dict[str, Any]:
    [c] = [c for c in containers(pdproxy_deployment(objects)) if is_pdproxy(c)]
    return c


def port_named(container: dict[str, Any], name: str) -> int:
    for port in container.get("ports", []):
        if port.get("name") == name:
            return int(port["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {name}")


@pytest.mark.parametrize("target", TARGETS)
def test_renders(rendered, target: str) -> None:
    objects = rendered(target)
    kinds = {o["kind"] for o in objects}
    assert "Deployment" in kinds
    if target in DEPLOYABLE:
        assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
        pdproxy_container(objects)  # exactly one pdproxy container
    if target == "servicemonitor":
        assert "ServiceMonitor" in kinds


@pytest.mark.parametrize("target", TARGETS)
def test_objects_match_the_kubernetes_schemas(rendered, target: str) -> None:
    for obj in rendered(target):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith(CRD_GROUPS):
            check_servicemonitor(obj)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{target}: {where}: {exc.message} at {'.'.join(map(str, exc.path))}")


def check_servicemonitor(obj: dict[str, Any]) -> None:
    """The fields of monitoring.coreos.com/v1 ServiceMonitor that this repo uses."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "ServiceMonitor"
    spec = obj["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    assert spec["selector"]["matchLabels"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scheme", "authorization"}
        assert endpoint["path"] == "/metrics"


def test_schema_validation_rejects_a_broken_manifest(rendered) -> None:
    """The validator is not vacuous: a misspelled field and a wrongly typed one both fail."""
    deployment = copy.deepcopy(pdproxy_deployment(rendered("base")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment = copy.deepcopy(pdproxy_deployment(rendered("base")))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_pods_are_locked_down(rendered, target: str) -> None:
    for name, spec in pod_specs(rendered(target)):
        # Service links would inject PDPROXY_PORT=tcp://... (read as --port) and VLLM_*_PORT.
        assert spec.get("enableServiceLinks") is False, name
        assert spec.get("automountServiceAccountToken") is False, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for c in spec["containers"]:
            where = f"{name}/{c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert not sc.get("privileged"), where
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], where
            if is_pdproxy(c) or is_register(c):
                # pdproxy's own image: non-root (the image's uid) on a read-only root fs
                merged = {**spec["securityContext"], **sc}
                assert merged["runAsNonRoot"] is True and merged["runAsUser"] == 10001, where
                assert sc["readOnlyRootFilesystem"] is True, where


def test_probe_paths_exist_in_pdproxy() -> None:
    paths = {route.path for route in router.routes}  # type: ignore[attr-defined]
    assert {"/health", "/ready", "/metrics"} <= paths


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_pdproxy_probes_scrape_and_drain(rendered, target: str) -> None:
    objects = rendered(target)
    c = pdproxy_container(objects)
    env = container_env(objects, c)
    port = int(env["PDPROXY_PORT"])
    assert port_named(c, "http") == port
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    pod = pdproxy_deployment(objects)["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # SIGTERM comes after preStop; the drain then takes up to the shutdown timeout, then
    # uvicorn's own shutdown: the kubelet must not SIGKILL before all of that.
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = int(pre_stop[1]) + float(env["PDPROXY_SHUTDOWN_TIMEOUT_SECS"]) + UVICORN_SHUTDOWN_SECS
    assert pod["spec"]["terminationGracePeriodSeconds"] > needed


@pytest.mark.parametrize("target", TARGETS)
def test_services_reach_their_pods(rendered, target: str) -> None:
    objects = rendered(target)
    deployments = of_kind(objects, "Deployment")
    for service in of_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        pods = [
            d["spec"]["template"]
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in pods:
                names = {
                    p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])
                }
                assert port["targetPort"] in names, (service["metadata"]["name"], port)
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def engine_containers(objects) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for d in of_kind(objects, "Deployment"):
        role = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in containers(d):
            if c["name"] == "vllm":
                found.append((role, c))
    return found


@pytest.mark.parametrize("target", ["engines/vllm-nixl", *DEPLOYABLE[1:-1]])
def test_engines_use_gpus_and_nixl_as_the_recipe(rendered, target: str) -> None:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    recipe = tomllib.loads((DEPLOY / "recipes" / "nixl-2p1d.toml").read_text())
    by_role = {e["role"]: e["kv_transfer_config"] for e in recipe["engines"]}
    objects = rendered(target)
    engines = engine_containers(objects)
    assert sorted(role for role, _ in engines) == ["decode", "prefill"]
    for role, c in engines:
        env = container_env(objects, c)
        args = [expand(a, env) for a in c["args"]]
        assert c["command"] == ["vllm", "serve"]
        assert "$(" not in " ".join(args), f"unexpanded variable in {args}"
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_role"] == by_role[role]["kv_role"]
        assert kv["kv_buffer_device"] == by_role[role]["kv_buffer_device"]
        assert f"--port={port_named(c, 'http')}" in args
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == env["POD_IP"]  # the pod's own address
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == port_named(c, "nixl")
        # one GPU per tensor-parallel rank
        [tp] = [a.split("=", 1)[1] for a in args if a.startswith("--tensor-parallel-size=")]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(tp)
        assert (
            c["resources"]["requests"]["nvidia.com/gpu"]
            == c["resources"]["limits"]["nvidia.com/gpu"]
        )


def test_1p1d_points_pdproxy_at_the_engine_services(rendered) -> None:
    objects = rendered("overlays/1p1d-nixl")
    env = container_env(objects, pdproxy_container(objects))
    assert env["PDPROXY_KV_CONNECTOR"] == "nixl"
    for role in ("prefill", "decode"):
        [url] = env[f"PDPROXY_{role.upper()}"].split()
        parts = urlsplit(url)
        service = named(objects, "Service", parts.hostname)
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == role
        assert parts.port in {p["port"] for p in service["spec"]["ports"]}
    served = named(objects, "ConfigMap", engine_config_name(objects))["data"]["SERVED_MODEL_NAME"]
    assert env["PDPROXY_MODEL"] == served


def engine_config_name(objects) -> str:
    [cm] = [c for c in of_kind(objects, "ConfigMap") if "SERVED_MODEL_NAME" in c.get("data", {})]
    return cm["metadata"]["name"]


def test_xpyd_engines_register_with_pdproxy(rendered) -> None:
    objects = rendered("overlays/xpyd-registered")
    proxy = pdproxy_container(objects)
    env = container_env(objects, proxy)
    registry_port = int(env["PDPROXY_REGISTRY_PORT"])
    assert port_named(proxy, "registry") == registry_port
    assert "PDPROXY_PREFILL" not in env and "PDPROXY_DECODE" not in env
    served = named(objects, "ConfigMap", engine_config_name(objects))["data"]["SERVED_MODEL_NAME"]
    assert env["PDPROXY_MODEL"] == served

    for role in ("prefill", "decode"):
        deployment = named(objects, "Deployment", f"vllm-{role}")
        assert deployment["spec"]["replicas"] >= 2
        [vllm] = [c for c in containers(deployment) if c["name"] == "vllm"]
        [sidecar] = [c for c in containers(deployment) if is_register(c)]
        sidecar_env = container_env(objects, sidecar)
        args = register.build_parser().parse_args([expand(a, sidecar_env) for a in sidecar["args"]])
        fmt, registrant = register.registrant_from_args(args)
        assert fmt == "p2p"  # the plain {type, http_address, zmq_address} heartbeat
        assert args.role == role
        assert registrant.http_address == f"{sidecar_env['POD_IP']}:{port_named(vllm, 'http')}"
        # --proxy is the registry Service, whose port leads to pdproxy's registry port
        proxy_url = urlsplit(args.proxy)
        service = named(objects, "Service", proxy_url.hostname)
        [port] = [p for p in service["spec"]["ports"] if p["port"] == proxy_url.port]
        assert port["targetPort"] == "registry"
        assert service["spec"]["publishNotReadyAddresses"] is True  # reachable before Ready
        # a healthy engine is never dropped between two heartbeats
        assert args.interval_s * 2 < float(env["PDPROXY_REGISTRY_TTL"])
        assert sidecar["image"] == proxy["image"]

    # one pdproxy, replaced rather than surged (see overlays/xpyd-registered/pdproxy-registry.yaml)
    spec = pdproxy_deployment(objects)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    # only the engine pods may reach the registry
    [policy] = of_kind(objects, "NetworkPolicy")
    [rule] = [r for r in policy["spec"]["ingress"] if r.get("from")]
    assert [p["port"] for p in rule["ports"]] == [registry_port]
    assert rule["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "vllm"}
