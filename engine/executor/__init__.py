"""Running a step on every tensor-parallel rank: executors, rank processes, the step wire and
the process-group state the layers use."""
