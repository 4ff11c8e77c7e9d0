"""The protocol lives in one place: every Lua script is in ``producers/protocol/``, and the set
of terminal statuses is spelled once, in Python, whatever the language that tests it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from producers.protocol import TERMINAL_STATUSES, Status

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "producers" / "protocol"
PACKAGES = ("engine", "sluiceway_kernels", "producers", "worker", "gateway", "bench", "sluiceway")
STATUS_VALUES = frozenset(status.value for status in Status)
LUA = re.compile(r"redis\.p?call\(")
LUA_STATUS = re.compile(r"(?:==|~=)\s*'(\w+)'")  # a Lua comparison with a status literal


def sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def strings(path: Path) -> list[ast.Constant]:
    """Every string constant of a module (the literal parts of f-strings included)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def status_sets(path: Path) -> list[str]:
    """``line: statuses`` for each place that spells two or more statuses as literals: a tuple,
    list or set of strings in Python, or one line of Lua comparing a status with each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            named = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in STATUS_VALUES}
            if len(named) >= 2:
                found.append(f"{node.lineno}: {sorted(named)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for offset, line in enumerate(node.value.splitlines()):
                named = set(LUA_STATUS.findall(line)) & STATUS_VALUES
                if len(named) >= 2:
                    found.append(f"{node.lineno + offset}: {sorted(named)}")
    return found


def test_every_lua_script_lives_in_the_protocol_package():
    outside = {str(path.relative_to(ROOT)): node.lineno for path in sources()
               if PROTOCOL not in path.parents for node in strings(path) if LUA.search(node.value)}
    assert not outside, f"Lua outside producers/protocol/ (file: line): {outside}"


def test_the_check_sees_lua_and_a_spelled_status_set(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('S = """\nif status == \'done\' or status == \'failed\' then redis.call(\'DEL\', KEYS[1]) end\n"""\n'
                      'for s in ("cancelled", "expired"): pass\nONE = ("running", "starting")\n')
    assert LUA.search(strings(source)[0].value)
    assert status_sets(source) == ["2: ['done', 'failed']", "4: ['cancelled', 'expired']"]


def test_no_code_spells_a_set_of_statuses():
    """Which statuses end a job is ``TERMINAL_STATUSES`` alone; the scripts' tests are generated."""
    spelled = {str(path.relative_to(ROOT)): found for path in sources() if (found := status_sets(path))}
    assert not spelled, f"statuses spelled out instead of taken from TERMINAL_STATUSES: {spelled}"


def test_the_generated_lua_names_exactly_the_terminal_statuses():
    from producers.protocol import scripts, worker_scripts

    assert worker_scripts._IS_TERMINAL in worker_scripts._PRELUDE
    body = worker_scripts._IS_TERMINAL.splitlines()[1]
    assert set(LUA_STATUS.findall(body)) == {s.value for s in TERMINAL_STATUSES}
    unless_live = next(line for line in scripts.CANCEL_SCRIPT.splitlines() if "then return status end" in line)
    assert set(LUA_STATUS.findall(unless_live)) == {s.value for s in Status if s not in TERMINAL_STATUSES}
    for name in ("START", "FINISH", "WRITE", "APPEND", "DEAD", "HEARTBEAT"):
        assert getattr(worker_scripts, name).startswith(worker_scripts._PRELUDE), name


def test_the_documented_dead_letter_fields_are_the_ones_the_scripts_write():
    from producers.protocol.worker_scripts import _PRELUDE

    doc = (ROOT / "PROTOCOL.md").read_text()
    table = doc[doc.index("`{prefix}:dead` entries"):].split("\n\n")[1]
    documented = [name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    call = re.search(r"local function dead_letter\(.*?\n(.*?)\nend", _PRELUDE, re.S).group(1)
    written = re.findall(r"'(\w+)', \w+", call.split("'*',", 1)[1])
    assert written == documented


def test_every_command_a_script_runs_is_granted_to_the_role_that_runs_it():
    """Redis checks each command inside a script against the caller's ACL, so a role that lacks
    one fails the whole script (tests/worker/test_script_acl.py runs them as the user). A
    ``redis.pcall`` is let off: the script goes on without it (the cancel script's XDEL)."""
    from producers.acl import PRODUCER, WORKER, WORKER_NO_CELERY
    from producers.protocol import scripts, worker_scripts

    runs = {PRODUCER: (scripts, ("SUBMIT_SCRIPT", "CANCEL_SCRIPT")),
            WORKER: (worker_scripts, ("START", "FINISH", "WRITE", "APPEND", "DEAD", "HEARTBEAT"))}
    runs[WORKER_NO_CELERY] = runs[WORKER]
    missing = {}
    for role, (module, names) in runs.items():
        granted = {command for grant in role.grants for command in grant.commands} | set(role.commands)
        for name in names:
            used = {c.lower() for c in re.findall(r"redis\.call\('(\w+)'", getattr(module, name))}
            if used - granted:
                missing[f"{role.name}: {name}"] = sorted(used - granted)
    assert not missing, f"commands the scripts run that their role does not grant: {missing}"


def test_every_error_code_a_script_writes_itself_is_one_of_the_closed_set():
    from producers.protocol import ErrorCode, scripts, worker_scripts

    texts = [scripts.SUBMIT_SCRIPT, scripts.CANCEL_SCRIPT] + [
        getattr(worker_scripts, name) for name in ("START", "FINISH", "WRITE", "DEAD")]
    literal = []
    for text in texts:
        # the code argument of each end_job(...) and dead_letter(...) call, and each HSET of the field
        for call in re.findall(r"(?<!function )\b(end_job|dead_letter)\((.*?)\)\n", text, re.S):
            args = [a.strip() for a in call[1].split(",")]
            assert len(args) == (13 if call[0] == "end_job" else 9), call  # every call passes a code
            literal += [a.strip("'") for a in args[-1:] if a.startswith("'")]
        literal += re.findall(r"'error_code', '(\w+)'", text)
    assert set(literal) == {"cancelled", "max_attempts_exceeded"}
    assert set(literal) <= {code.value for code in ErrorCode}
