"""Moving KV blocks between executors: the interface (base.py), the cache's byte ranges
(regions.py) and NIXL behind it (nixl.py). The NATS fallback lives in services/executor/
kv_nats.py, since it needs NATS."""
