"""The ``sluiceway`` command: one entry point over every side's commands (``sluiceway.cli``)."""
