"""The probes an instance passes before it is routable (``Membership``'s admission).

``GET /v1/models`` must answer vLLM's shape, ``{"data": [{"id": ...}, ...]}`` (its models
decide the requests it takes, ``pdproxy.fleet.models``), and list the ``--model`` if one is
set; a Mooncake prefill's bootstrap
``/query`` must list its engine ids. An answer of another shape (``{"data": "abc"}``, a list,
a body that is not JSON) is a refusal with its reason, never an exception.
"""

from __future__ import annotations

from typing import Any

from pdproxy.config.proxy import ProxyConfig
from pdproxy.connectors import KVConnector
from pdproxy.errors import UpstreamError
from pdproxy.membership.identity import reidentify
from pdproxy.types import Endpoint, Role, Source
from pdproxy.upstream.engine_client import EngineClient

NOT_MODELS = (
    'its /v1/models answer is not {"data": [{"id": ...}, ...]} of at most'
    " --max-models-per-instance models"
)


class InstanceChecks:
    def __init__(self, config: ProxyConfig, client: EngineClient, connector: KVConnector) -> None:
        self._model = config.model
        self._max_models = config.health.max_models
        self._client = client
        self._connector = connector

    def bootstrap_url(self, endpoint: Endpoint) -> str | None:
        if endpoint.role is not Role.PREFILL:
            return None
        return self._connector.prefill_bootstrap_url(endpoint.address)

    async def run(self, endpoint: Endpoint, *, require_reachable: bool) -> str | None:
        """None when admissible; a reason when refused; "" when unreachable (retry later).
        Fills in ``endpoint.models`` and ``endpoint.engine_ids``."""
        try:
            # A static instance's models are read by ``ModelReader``'s first round; refusing
            # one the command line named for its /v1/models is --model's business only.
            if self._model is not None or require_reachable or endpoint.source is not Source.STATIC:
                problem = await self._check_model(endpoint)
                if problem:
                    return problem
            bootstrap = self.bootstrap_url(endpoint)
            if bootstrap is not None:
                answer = await self._client.get_json(bootstrap)
                reidentify(endpoint, engine_ids=self._connector.parse_bootstrap(answer))
        except (UpstreamError, ValueError) as exc:
            if require_reachable:
                return f"instance did not answer its probe: {exc}"
            return ""
        return None

    async def _check_model(self, endpoint: Endpoint) -> str | None:
        """A reason when ``/v1/models`` is not vLLM's shape or lacks ``--model``; raises
        ``UpstreamError`` when the instance cannot be reached."""
        try:
            answer: Any = await self._client.get_json(endpoint.url + "/v1/models")
        except ValueError:  # not JSON
            return NOT_MODELS
        models = served_models(answer, self._max_models)
        if models is None:
            return NOT_MODELS
        reidentify(endpoint, models=models)
        if self._model is not None and self._model not in models:
            return f"serves {list(models)}, not model {self._model!r}"
        return None


MAX_MODEL_ID = 512  # characters: an id longer than this is no model name


def served_models(answer: Any, limit: int = 1024) -> tuple[str, ...] | None:
    """The model ids of a ``/v1/models`` answer; None when it is not vLLM's shape or lists
    more than ``limit`` models (``--max-models-per-instance``: each is a pool, metric series
    and memory). Ids longer than ``MAX_MODEL_ID`` are left out."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) > limit:
        return None
    if not all(isinstance(m, dict) for m in data):
        return None
    return tuple(
        m["id"] for m in data if isinstance(m.get("id"), str) and len(m["id"]) <= MAX_MODEL_ID
    )
