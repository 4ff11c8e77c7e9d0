"""``sluiceway bench``: the engine on dummy weights of a real architecture, with numbers to compare.

Each workload is a click command in a module of its own, loaded when it runs (or when the
help lists it), so that ``sluiceway bench --help`` needs no GPU stack. ``bench.common``
holds what they share: the engine's flags, building the ``LLM``, the environment, the
roofline result and the output (summary lines, ``--json PATH``); ``bench.run`` the timed
run and its per-step statistics.

    sluiceway bench throughput --model llama3-8b --peer hf --roofline --json out.json
    python -m bench latency --input-len 128 --output-len 256
"""

from __future__ import annotations

import importlib
import logging
import os

import click

# name -> (module, attribute of a click command)
WORKLOADS: dict[str, tuple[str, str]] = {
    "throughput": ("bench.throughput", "throughput_command"),
    "latency": ("bench.latency", "latency_command"),
    "worker": ("bench.worker", "worker_command"),
    "tp": ("bench.tp", "tp_command"),
    "swap": ("bench.swap", "swap_command"),
    "grading": ("bench.grading", "grading_command"),
    "mixed": ("bench.mixed", "mixed_command"),
    "batch": ("bench.batch", "batch_command"),
    "gateway": ("bench.gateway", "gateway_command"),
    "stream-writes": ("bench.stream_writes", "stream_writes_command"),
    "fleet": ("bench.fleet", "fleet_command"),
}


class _WorkloadGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        from engine.errors import ModelNotFound

        try:
            return super().invoke(ctx)
        except ModelNotFound as exc:  # --model neither a preset nor a folder: one line, not the loader's stack
            raise click.ClickException(f"model: {exc}") from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *WORKLOADS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in WORKLOADS:
            return super().get_command(ctx, name)
        module, attribute = WORKLOADS[name]
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise click.ClickException(f"bench workload {name!r} ({module}:{attribute}) is unavailable: {err}")


@click.group("bench", cls=_WorkloadGroup)
def bench_command() -> None:
    """Benchmark the engine on dummy weights of a named architecture (see engine.models.presets)."""
    logging.basicConfig(level=os.environ.get("SLUICEWAY_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    bench_command()
