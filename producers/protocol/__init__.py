"""Protocol v1: the contract between producers and workers (see PROTOCOL.md)."""

from producers.protocol.schemas import *  # noqa: F401,F403
from producers.protocol.schemas import _ID_RE  # noqa: F401
