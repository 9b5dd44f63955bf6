"""vLLM's extras: /version, /tokenize and /detokenize (routes.py) and the tokenizer bodies (bodies.py)."""
