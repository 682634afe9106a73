"""Fault-tolerance policy, free of I/O: which failures are retried, how many retries the
fleet can afford, and which instances are ejected from rotation.

Every class here is driven by an injected clock (and RNG) and mutates only the state it is
handed, so it is unit-tested without sockets. The tasks that probe and the orchestrator
that retries sit one layer up and only feed it.
"""
