"""The command line: argv and the ``PDPROXY_*`` environment made into a ``ProxyConfig``, handed to
the runtime. ``flag`` is the one record a flag is declared as (and the parser, environment and
config mapping derived from a table of them), ``flags`` and ``flag_tables`` the table by
``--help`` group, ``values`` what the few composite flags turn into, ``main`` parses and runs one
process or ``--workers N``."""
