"""The fleet's control plane: which engine instances exist and may be routed to. ``membership``
admits instances from every source (the command line, the admin API, registrations), ``health``
probes them, ``load_scraper`` reads their load, ``warmup`` warms new pairs; before any is
admitted, ``guard`` refuses pdproxy itself and a second name of a known instance,
``instance_checks`` asks the instance what it serves; ``discovery`` holds the sources that feed
it and ``workers`` the channel that carries the owner's membership to ``--workers`` processes.
It writes the registry (``pdproxy.fleet``) and never sees a request."""
