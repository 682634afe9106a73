"""ExampleConnector (shared storage): no params; P stores blocks, D finds them by prompt hash.

The legs are serial (D must not be scheduled before P has written the blocks) and carry no
``kv_transfer_params``: ``SerialConnector``'s defaults. LMCache's P-then-D deployments use
the same shaping. A decode's read leaves the stored blocks in place, so a failed decode is
always retried on another decode without a new prefill.
"""

from __future__ import annotations

from pdproxy.connectors import SerialConnector, Transfer


class ExampleConnector(SerialConnector):
    routes_decode_rank = True  # every rank of D reads the shared storage alike

    def decode_retry_reuses_prefill(self, transfer: Transfer, reason: str) -> bool:
        return True
