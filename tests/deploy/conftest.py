from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.manifests import (
    BASE,
    ENGINES,
    OVERLAYS,
    ToolMissing,
    kubectl,
    render,
    render_with_servicemonitor,
)

# Every directory the tests render: the base, the shared engines, each overlay, and the base
# with the optional ServiceMonitor component.
TARGETS = ["base", "engines/vllm-nixl", *(f"overlays/{p.name}" for p in OVERLAYS), "servicemonitor"]
# What an operator applies: each of these has pdproxy in it.
DEPLOYABLE = ["base", *(f"overlays/{p.name}" for p in OVERLAYS), "servicemonitor"]


@pytest.fixture(scope="session")
def kubectl_path() -> str:
    try:
        return kubectl()
    except ToolMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def rendered(kubectl_path: str, tmp_path_factory: pytest.TempPathFactory):
    """target name -> its rendered objects (rendered once per session)."""
    workdir = tmp_path_factory.mktemp("kustomize") / "base-with-servicemonitor"

    def get(target: str) -> tuple[dict[str, Any], ...]:
        if target == "servicemonitor":
            return render_with_servicemonitor(workdir)
        if target == "base":
            return render(BASE)
        if target == "engines/vllm-nixl":
            return render(ENGINES)
        return render(BASE.parent / target)

    return get
