"""ExampleConnector (shared storage): no params; P stores blocks, D finds them by prompt hash.

The legs are serial (D must not be scheduled before P has written the blocks) and carry no
``kv_transfer_params``: exactly ``SerialConnector``'s defaults. LMCache's P-then-D
deployments use the same shaping.
"""

from __future__ import annotations

from pdproxy.connectors import SerialConnector


class ExampleConnector(SerialConnector):
    pass
