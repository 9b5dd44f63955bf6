"""OpenAI's Responses API: the routes (routes.py) over the chat path, the Responses body as a chat body (body.py),
the response object and its typed events (response_object.py), and the stored responses (store.py)."""
