"""The ASGI handlers: the OpenAI generation endpoints (``openai``, the hot path) and the
pass-through ones (``passthrough``), the read-only endpoints (``info``), the admin API
(``admin``), the dashboard (``dashboard``), client keys (``auth``), the end of a request's
record (``access``), errors in OpenAI's shape (``errors``) and the one state they share
(``state``); ``app`` puts each on its route. Nothing is built here: ``pdproxy.app`` builds and
wires."""
