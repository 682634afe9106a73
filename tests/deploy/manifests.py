"""What the deploy tests read: the repository's deploy/ files, rendered and parsed.

Kubernetes manifests are rendered with `kubectl kustomize` (the kustomize that ships inside
kubectl). Debian's `kubernetes-client` is kubectl 1.20, whose kustomize (v2.0.3) predates
components and `labels:`; such a kubectl is reported as too old rather than trusted.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
ENGINES = KUBERNETES / "engines" / "vllm-nixl"
SERVICEMONITOR = KUBERNETES / "components" / "servicemonitor"
OVERLAYS = sorted(p for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"
UNIT = DEPLOY / "systemd" / "pdproxy.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "pdproxy.env.example"

KUSTOMIZE_MIN = (4, 0)  # components and `labels:` (kubectl >= 1.21)
# The Kubernetes version the rendered objects are validated against (kubernetes-validate
# bundles the schemas of 1.25 and later); 1.32 is what the manifests are written for.
K8S_VERSION = "1.32"


class ToolMissing(Exception):
    """A tool the test needs is absent or unusable here; the message says why."""


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise ToolMissing(
            "kubectl not found: .ci/run installs it (apt-get install kubernetes-client) "
            "when missing; locally, install kubectl >= 1.21"
        )
    if not kustomize_is_recent(path):
        raise ToolMissing(
            f"{path} is older than 1.21: its built-in kustomize (v2) cannot render components; "
            "install kubectl >= 1.21"
        )
    return path


@functools.cache
def kustomize_is_recent(path: str) -> bool:
    """kubectl's own kustomize is v4 or later: kubectl >= 1.21 (which prints its kustomize
    version only from 1.24 on)."""
    out = subprocess.run(
        [path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
    )
    try:
        info = json.loads(out.stdout)
    except ValueError:
        return False
    kustomize = [int(n) for n in re.findall(r"\d+", info.get("kustomizeVersion", ""))[:2]]
    if kustomize:
        return tuple(kustomize) >= KUSTOMIZE_MIN
    client = info.get("clientVersion", {})
    minor = re.match(r"\d+", client.get("minor", ""))
    return client.get("major") == "1" and minor is not None and int(minor[0]) >= 21


@functools.cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize DIR`, parsed; raises AssertionError with kustomize's message."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def render_with_servicemonitor(workdir: Path) -> tuple[dict[str, Any], ...]:
    """The base plus the optional ServiceMonitor component, as an overlay would add it."""
    workdir.mkdir(parents=True, exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(BASE, workdir)],
        "components": [os.path.relpath(SERVICEMONITOR, workdir)],
    }
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(workdir)


def of_kind(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    for o in of_kind(objects, kind):
        if o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind} {name}")


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def command_of(container: dict[str, Any]) -> list[str]:
    """What the container runs: its command, or the image's ENTRYPOINT (pdproxy for ours)."""
    return list(container.get("command") or [])


def is_pdproxy(container: dict[str, Any]) -> bool:
    image = container["image"].split("@")[0].rsplit(":", 1)[0]
    return image.rsplit("/", 1)[-1] == "pdproxy" and not container.get("command")


def is_register(container: dict[str, Any]) -> bool:
    return command_of(container)[:1] == ["pdproxy-register"]


def container_env(objects: tuple[dict[str, Any], ...], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env;
    a value from a Secret or the downward API becomes a placeholder."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref, f"only configMapRef envFrom is expected, got {source}"
        env.update(named(objects, "ConfigMap", ref["name"]).get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            env[var["name"]] = placeholder(var["name"], var["valueFrom"])
    return env


def placeholder(name: str, source: dict[str, Any]) -> str:
    if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
        return "10.244.1.7"
    return f"secret-{name.lower()}"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def pod_specs(objects: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    for deployment in of_kind(objects, "Deployment"):
        yield deployment["metadata"]["name"], deployment["spec"]["template"]["spec"]


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """A systemd unit's `Key=value` lines, per key in order (a key may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """The VAR=value lines of a systemd EnvironmentFile (comments and blanks skipped)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not VAR=value: {line!r}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def commented_env_names(path: Path = ENV_EXAMPLE) -> set[str]:
    """Variables the env file offers commented out (`#PDPROXY_X=...`)."""
    return set(re.findall(r"^#\s?([A-Z][A-Z0-9_]*)=", path.read_text(), flags=re.M))
