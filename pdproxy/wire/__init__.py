"""Pure vLLM and OpenAI formats, no I/O: the bodies of both legs (``shaping``), the endpoints
relayed whole (``routes``), tokenize-once's render and generate bodies (``tokenize_once``) and
its answers put back in OpenAI's shape (``derender``), an engine's load figures from its
``/metrics`` text (``engine_stats``), a body's fields typed as vLLM reads them (``body_fields``
over ``coerce``), the ``Via`` marker of pdproxy's own legs (``hop``), a cut stream's continuation
(``continuation``), the prefill's first token as the stream's first chunk and the decode's body
after it (``first_token``), a text prompt's token ids as vLLM computes them (``local_tokenizer``
over ``chat_template``; its model files are read once, at start-up)."""
