"""Every benchmark of Sluiceway: ``sluiceway bench`` / ``python -m bench`` (see ``bench.cli``).

Workloads: throughput, latency, swap, tp (``bench.throughput``, ``bench.latency``,
``bench.swap``, ``bench.tp``), the worker through Redis (``bench.worker``), the Triton kernels
(``python -m bench.kernels``); HF transformers as the peer (``bench.hf_peer``); the roofline
bound (``bench.roofline``); the timed run and its step log (``bench.run``).

NOTE: nothing in engine, kernels, worker or producers imports this package; it may import
all of them.
"""
