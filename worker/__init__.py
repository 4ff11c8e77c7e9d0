"""The long-lived GPU worker: drains protocol-v1 queues into the engine (``sluiceway worker``).

Nothing in ``producers`` imports this package; it imports ``producers.protocol`` and ``engine``.
"""

__version__ = "0.1.0"
