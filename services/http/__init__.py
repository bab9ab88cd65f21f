"""The OpenAI-compatible HTTP gateway and Prometheus metrics: HTTP onto kvpager's NATS API."""
