"""``python -m worker ...`` is ``sluiceway worker ...``."""

from worker.cli import main

if __name__ == "__main__":
    main()
