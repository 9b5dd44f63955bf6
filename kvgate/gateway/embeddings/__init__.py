"""OpenAI's embeddings: the route (routes.py); the dialect is kvgate/openai/embeddings.py."""
