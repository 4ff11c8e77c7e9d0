"""``python -m sluiceway ...`` is ``sluiceway ...``."""

from sluiceway.cli import main

if __name__ == "__main__":
    main()
