"""``--workers N``: several serving processes on one port, one membership owner.

``supervisor`` (the parent: supervision and the membership owner, and why), ``owner`` (what
the owner runs), ``hub`` and ``link`` (the owner's and a worker's side of the ``ipc://``
channel), ``snapshot`` (its wire format), ``child`` (a worker's entry point), ``multiproc``
(``/metrics`` over every process), ``restart`` (the restart backoff), ``spec`` (the run
directory and a worker's orders). docs/scale-out.md explains it for operators.
"""
