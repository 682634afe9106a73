"""The request path: one client request through the fleet, free of any web framework.
``orchestrator`` runs a prefill/decode request over the two ``legs``; ``passthrough`` serves
a request whole on one instance and ``render_once`` renders a text request once; both the
orchestrator and the pass-through retry a failed leg by one ``retries`` run; ``relay`` streams
the decode's answer back as bytes, and ``migration`` continues a stream cut mid-answer on
another decode, ``first_token`` starts a stream with the prefill's token
(``--first-token-from-prefill``), ``kv_release`` releases KV no decode will read,
``verdicts`` judges each leg for passive health, ``admission`` bounds the requests served at
once, ``lifecycle`` holds readiness and the drain, ``exchange`` says what a request is and
what goes back, ``prompt_tokens`` gives a text request its token ids for ``kv-events``
(``--tokenizer``)."""
