"""pdproxy: a standalone, stateless XpYd prefill/decode proxy for vLLM."""

from __future__ import annotations

from pdproxy.config.proxy import ProxyConfig

__version__ = "0.1.0"
__all__ = ["ProxyConfig", "__version__", "create_app"]


def __getattr__(name: str) -> object:
    # create_app pulls in FastAPI; keep `import pdproxy` light for the CLI's --help.
    if name == "create_app":
        from pdproxy.app import create_app

        return create_app
    raise AttributeError(name)
