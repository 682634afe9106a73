"""What pdproxy shows of itself: Prometheus metrics (``metrics``; across ``--workers`` processes,
``multiproc``), traces (``tracing``, the only module that imports OpenTelemetry), logs (``log``)
carrying each request's record (``request_context``), and the dashboard's windowed figures
(``fleet_view``)."""
