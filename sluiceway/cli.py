"""The ``sluiceway`` command line: one group whose commands live with the package they drive.

Each command is imported only when it runs (click's lazy-group pattern), so ``sluiceway
submit`` never loads torch or the worker, and a producer-only install (``pip install
sluiceway``, no ``[worker]`` extra) still runs the producer commands:

- ``submit``, ``result``, ``status``, ``cancel``, ``bulk``, ``acl``: ``producers/cli.py``;
- ``worker``: ``worker/cli.py``; ``demo``: ``worker/demo.py``;
- ``serve``: ``gateway/cli.py``;
- ``bench``: ``bench/cli.py``.

NOTE: this is the only place that names the packages' commands, so that no package reaches
up to a higher one (producers to the worker, the engine to the bench) to offer them.

Every option can also come from the environment: ``SLUICEWAY_REDIS_URL``,
``SLUICEWAY_PREFIX``, and ``SLUICEWAY_<COMMAND>_<OPTION>`` for the rest (e.g.
``SLUICEWAY_BULK_MAX_OUTSTANDING``).
"""

from __future__ import annotations

import importlib
import sys

import click

# name -> (module, attribute of a click command, one-line help or None). With None the help
# comes from the command itself, which is then imported for ``--help``: only the light ones.
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "submit": ("producers.cli", "submit", None),
    "result": ("producers.cli", "result", None),
    "status": ("producers.cli", "status", None),
    "cancel": ("producers.cli", "cancel", None),
    "bulk": ("producers.cli", "bulk", None),
    "acl": ("producers.cli", "acl", None),
    "worker": ("worker.cli", "worker_command", "Run a GPU worker that drains the queues."),
    "serve": ("gateway.cli", "serve_command", "Serve the OpenAI-compatible HTTP API over the queues."),
    "bench": ("bench.cli", "bench_command", "Benchmark the engine (dummy weights) and print JSON."),
    "demo": ("worker.demo", "demo_command", "Try Sluiceway end to end on a tiny local model."),
}


class LazyGroup(click.Group):
    """A group whose commands are imported when they run; heavy ones not for ``--help``."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            return _load(name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            help_text = COMMANDS[name][2] if name in COMMANDS else None
            if help_text is None:
                command = self.get_command(ctx, name)
                help_text = command.get_short_help_str(formatter.width - 6 - len(name)) if command else ""
            rows.append((name, help_text))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _load(name: str) -> click.Command:
    """The command ``name``, or one that explains why it cannot run here."""
    module_name, attribute, help_text = COMMANDS[name]
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except ImportError as exc:
        if exc.name and module_name.startswith(exc.name):
            why = f"this installation has no {module_name}"
        else:
            why = f"it needs {exc.name or exc} (install the GPU side: pip install 'sluiceway[worker]')"
    except AttributeError:
        why = f"{module_name} has no {attribute}"
    message = f"`sluiceway {name}` is unavailable: {why}."

    @click.command(name, help=help_text, add_help_option=False,
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def unavailable() -> None:
        raise click.ClickException(message)

    return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sluiceway")
def cli() -> None:
    """Sluiceway: LLM inference through Redis queues."""


def main() -> None:
    from redis.exceptions import ConnectionError as RedisUnreachable, NoPermissionError, ReadOnlyError
    from redis.exceptions import TimeoutError as RedisTimeout

    try:
        cli(auto_envvar_prefix="SLUICEWAY")
    except (RedisUnreachable, RedisTimeout, NoPermissionError, ReadOnlyError) as exc:
        # NOTE: the clients ride a short outage (producers.jobs.OUTAGE_WINDOW_S) before they give
        # up: what is left to say is which server and why, in one line. So for a Redis user the
        # ACL refuses (NOPERM; a wrong password is a connection error) and a read-only replica
        # given as the URL: the operator's setting, not a fault of ours to show as a traceback.
        click.echo(f"error: redis: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
