"""One worker of ``sluiceway bench fleet``: a real ``Worker`` on the bench-only instant engine.

    python -m bench.fleet_worker REDIS_URL NAME MAX_NUM_SEQS TOKENS_PER_STEP STEP_MS [QUEUE_SHARDS]

Started by ``bench/fleet.py`` only (``sluiceway worker`` never builds this engine). SIGTERM
drains and stops it as it does any worker.
"""

from __future__ import annotations

import sys

from bench.instant_engine import InstantEngine


def main(argv: list[str]) -> int:
    from worker.logs import configure
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    url, name, max_num_seqs, tokens_per_step, step_ms = argv[:5]
    queue_shards = int(argv[5]) if len(argv) > 5 else 0
    configure("WARNING")
    settings = WorkerSettings(model="instant", redis=url, name=name, swap_space="0", celery=False,
                              log_level="WARNING", grace_period=5.0, queue_shards=queue_shards)
    engine = InstantEngine(max_num_seqs=int(max_num_seqs), tokens_per_step=int(tokens_per_step),
                           step_s=float(step_ms) / 1000)
    worker = Worker(settings, engine=engine)
    worker.install_signal_handlers()
    return worker.work()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
