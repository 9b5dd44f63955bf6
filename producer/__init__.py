"""kvfleet producer SDK: enqueue generation jobs on Redis Streams and read their results."""
