"""The membership owner's channel to its ``--workers`` processes over ``ipc://`` sockets: the
owner's side (``hub``: snapshots out, admin writes in), a worker's side (``link``: the snapshots
into its own registry) and their wire format (``snapshot``)."""
