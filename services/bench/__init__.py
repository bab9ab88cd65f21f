"""`kvpager bench`: load clients for a running kvpager (HTTP or NATS) and the offline engine's
throughput and latency, with the metrics they report (TTFT, TPOT, ITL, tokens/s)."""
