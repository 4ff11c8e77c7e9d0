"""``sluiceway serve``: an OpenAI-compatible HTTP API over the protocol-v1 queues.

Stateless: any number of gateway processes serve one Redis. Nothing here imports torch, the
engine or the worker; the gateway speaks the protocol through ``producers`` alone.
"""
