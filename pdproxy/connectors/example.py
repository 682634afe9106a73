"""ExampleConnector (shared storage): no params; P stores blocks, D finds them by prompt hash.

The legs are serial: D must not be scheduled before P has written the blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdproxy.config import ProxyConfig
from pdproxy.connectors import Transfer
from pdproxy.shaping import JSONBody, client_request_id, decode_body, prefill_body
from pdproxy.types import PairDecision


class ExampleConnector:
    concurrent = False

    @classmethod
    def from_config(cls, config: ProxyConfig) -> ExampleConnector:
        return cls()

    def begin(self, decision: PairDecision, client_request_id_: str | None) -> Transfer:
        return Transfer(decision, client_request_id(client_request_id_))

    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        return prefill_body(original, None)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        return decode_body(original, None)
