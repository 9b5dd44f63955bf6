"""OpenAI's chat completions and completions: the body planned into jobs (plan.py, prompts.py), the answers' bodies
(bodies.py) and their server-sent events (sse.py, replay.py), and the routes (routes.py)."""
