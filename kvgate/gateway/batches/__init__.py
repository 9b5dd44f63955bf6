"""OpenAI's files and batches: their routes (file_routes.py, batch_routes.py), the file store (file_store.py), and the
managed batches a gateway runs (batch_runner.py, batch_work.py, batch_input.py, batch_quota.py, batch_store.py)."""
