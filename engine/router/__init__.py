"""Routing requests across replicas: the KV-aware index of which instance caches which
blocks, and the routers over it.
"""
