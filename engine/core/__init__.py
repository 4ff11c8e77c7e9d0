"""The plain-Python core: sequences, scheduler, block manager (GPU pool, CPU swap pool, prefix
cache), stopping and the preemption policy. No torch."""
