"""The ``sluiceway`` command: every side's commands, each loaded only when it is used."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from sluiceway.cli import COMMANDS, cli

HEAVY = ("torch", "worker", "bench", "transformers")


def loaded_after(*args: str) -> list[str]:
    """The heavy top-level modules imported by running ``sluiceway ARGS`` in a fresh interpreter."""
    code = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from sluiceway.cli import cli\n"
        f"result = CliRunner().invoke(cli, {list(args)!r})\n"
        "assert result.exit_code == 0, result.output\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_producer_commands_load_neither_torch_nor_the_worker_nor_the_bench():
    assert loaded_after("submit", "--help") == []
    assert loaded_after("--help") == []
    assert loaded_after("bulk", "--help") == []
    assert loaded_after("serve", "--help") == []


def test_every_command_is_listed_and_its_help_works():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == sorted(COMMANDS) == ["acl", "bench", "bulk", "cancel", "demo", "result", "serve", "status", "submit",
                                                "worker"]
    for name, expected in (("bench", "throughput"), ("worker", "--redis"), ("demo", "--cache-dir"),
                           ("submit", "--wait"), ("bulk", "--max-outstanding"), ("serve", "--api-key")):
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert expected in result.output, name
    result = CliRunner().invoke(cli, ["bench", "latency", "--help"])
    assert result.exit_code == 0 and "--batch-size" in result.output


def test_the_module_and_the_bench_run_as_python_m():
    for module, expected in (("sluiceway", "Sluiceway: LLM inference through Redis queues."),
                             ("bench", "Benchmark the engine on dummy weights")):
        run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and expected in run.stdout, run.stderr[-2000:]
        assert f"Usage: python -m {module} " in run.stdout


def test_a_command_whose_package_is_not_installed_says_so():
    """A producer-only install has no worker package: ``sluiceway worker`` explains, the rest runs."""
    code = (
        "import sys\n"
        "sys.modules['worker'] = None  # as if the package were not installed\n"
        "from click.testing import CliRunner\n"
        "from sluiceway.cli import cli\n"
        "result = CliRunner().invoke(cli, ['worker', '--model', 'm'])\n"
        "print(result.exit_code, result.output)\n"
        "assert CliRunner().invoke(cli, ['submit', '--help']).exit_code == 0\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("1 Error: `sluiceway worker` is unavailable: this installation has no worker.cli.")


def test_a_redis_that_stays_away_ends_a_command_with_one_line_not_a_traceback(monkeypatch, capsys):
    import pytest

    from producers.embedded_redis import free_port
    from producers.jobs import Outage
    from sluiceway.cli import main

    monkeypatch.setattr(Outage.__init__, "__defaults__", (0.3, None))  # the outage ridden: 0.3 s, not 30
    port = free_port()  # nothing listens there
    for args in (["status", "some-job"], ["submit", "hello"], ["result", "some-job"]):
        monkeypatch.setattr(sys, "argv", ["sluiceway", *args, "--redis", f"redis://127.0.0.1:{port}/0"])
        with pytest.raises(SystemExit) as ended:
            main()
        assert ended.value.code == 1, args
        err = capsys.readouterr().err
        assert f"error: redis: Error 111 connecting to 127.0.0.1:{port}. Connection refused." in err, (args, err)


def test_the_worker_and_the_gateway_say_their_defaults_in_their_help():
    """Their options stay unset (None) so that the environment can fill them: the help says each
    settings default itself, as the settings hold it."""
    import re

    from gateway.settings import GatewaySettings
    from worker.settings import WorkerSettings

    worker = " ".join(CliRunner().invoke(cli, ["worker", "--help"], terminal_width=400).output.split())
    serve = " ".join(CliRunner().invoke(cli, ["serve", "--help"], terminal_width=400).output.split())
    for flag, shown in (("--queues", "interactive,bulk"), ("--claim-idle-seconds", "60"), ("--late-admission", "off"),
                        ("--cancel-poll-seconds", "0.2"), ("--prefix", "sluiceway")):
        assert re.search(rf"{flag} [^[]*\[default: {re.escape(shown)}; env: SLUICEWAY_", worker), flag
    assert WorkerSettings.model_fields["claim_idle_seconds"].default == 60  # what the help says is the settings'
    assert f"[default: {GatewaySettings.model_fields['port'].default}; env: SLUICEWAY_PORT]" in serve
    assert "--model TEXT" in worker and "[env: SLUICEWAY_MODEL]" in worker  # no default: none shown
