"""PROTOCOL.md shows the reference client's scripts; they must be the ones the client runs."""

import re
from pathlib import Path

import pytest

from producers.protocol import CANCEL_SCRIPT, SUBMIT_SCRIPT

DOC = (Path(__file__).resolve().parents[2] / "PROTOCOL.md").read_text()


def lua_blocks() -> list[list[str]]:
    """The code lines of each ```lua block, comments left out."""
    blocks = re.findall(r"```lua\n(.*?)```", DOC, flags=re.S)
    return [[line for line in block.strip().splitlines() if not line.startswith("--")] for block in blocks]


@pytest.mark.parametrize("script", [SUBMIT_SCRIPT, CANCEL_SCRIPT], ids=["submit", "cancel"])
def test_the_documented_script_is_the_one_the_client_runs(script):
    assert script.strip().splitlines() in lua_blocks()
