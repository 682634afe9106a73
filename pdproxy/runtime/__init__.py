"""The processes pdproxy runs as: uvicorn with a graceful drain (``server``) on pdproxy's own
protocol, which bounds what each client may send and hold (``listener``), and, under ``--workers
N``, a supervisor (``supervisor``) that runs N serving processes (``child``) on one port beside
one membership owner (``owner``), restarting a dead worker with backoff (``restart``). The
owner's channel to the workers is ``pdproxy.membership.workers``, their shared ``/metrics`` is
``pdproxy.observability.multiproc``; docs/scale-out.md explains it for operators."""
