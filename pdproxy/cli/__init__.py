"""The command line: argv and the ``PDPROXY_*`` environment made into a ``ProxyConfig``, handed to
the runtime. ``flags`` declares the flags by concern with one help sentence each,
``flag_tables`` the numeric ones as tables, ``main`` maps them onto the config and runs one
process or ``--workers N``."""
