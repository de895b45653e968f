"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``) over the
same proxy as the chat route.

Design: a Responses request is translated ONCE into the worker's chat-completions body
(``request.py``) and then runs as a chat request -- admission, routing (``user``, else
``prompt_cache_key``, is the routing key), retries before the commit point, aborts, deadlines,
tenants, metrics under the route label ``/v1/responses``. It is not relayed to SGLang's own
``/v1/responses``: that endpoint keeps conversation state inside one worker process (so
``previous_response_id`` would break across workers and gateway replicas), reports none of the
acceptance figures the gateway reads, and would need a second stream observer for its own event
grammar. The answer comes back translated: a whole chat completion into a Response object
(``response.py``), a chat stream event by event into the Responses event grammar (``stream.py``).
Whole errors take OpenAI's error shape; a failure after the stream began ends it with
``response.failed`` (``serve.py``). Stored responses (``previous_response_id``, ``GET``/``DELETE``)
live in ``app.response_store`` when ``responses.store`` is configured; stateless otherwise.
"""
