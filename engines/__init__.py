"""Runnable engines for pdproxy: the simulated vLLM engine lives in `engines.sim`."""
