"""ExampleConnector (shared storage): no params; P stores blocks, D finds them by prompt hash.

The legs are serial: D must not be scheduled before P has written the blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdproxy.connectors import SerialConnector, Transfer
from pdproxy.shaping import JSONBody, decode_body, prefill_body


class ExampleConnector(SerialConnector):
    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        return prefill_body(original, None)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        return decode_body(original, None)
