"""OpenAI's dialect, spoken by `kvgate serve` (kvgate.gateway) and `kvgate batch` alike: the Batch file format
(batch.py) and a result's choice in OpenAI's response shapes (shapes.py). It builds on the SDK only, never on the
gateway's web stack or torch, so `kvgate batch` runs on the SDK's install."""
