"""The configuration pdproxy runs on: frozen dataclasses, validated once when built and never
written after. ``proxy`` holds the whole (``ProxyConfig``) and the name tables its flags choose
from; each section has its own module: ``listener`` (TLS to clients, admission, the bounds on a
client's connection), ``upstream`` (timeouts, pools and TLS towards the engines), ``resilience``
(retries, active and passive health), ``registry`` (where instances come from), ``scheduling``
(the policies), ``workers`` (what a ``--workers`` process is told at start) and ``addresses``
(``host:port`` and URL parsing, each address's one canonical form and identity). No I/O here."""
