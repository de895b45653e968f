"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the
same proxy as the OpenAI routes.

A Messages request is translated once into the worker's chat-completions body
(``request.py``), then runs as a chat request: admission, routing (``metadata.user_id`` is the
``user`` routing key), retries before the commit point, aborts, deadlines and metrics. The
answer comes back translated: a whole chat completion into a Message (``response.py``), a chat
stream event by event into Anthropic's event grammar (``stream.py``, plugged into the relay as
the stream's observer). Errors and keep-alives take Anthropic's shape (``shape.py``); the routes
themselves are served in ``serve.py``.
"""
