"""OpenAI's own API: ``POST /v1/chat/completions`` and ``POST /v1/completions``, the workers' API
relayed as they send it (``serve.py``: the entries; ``schema.py``: the bodies and errors
``/openapi.json`` declares)."""
