"""The producer commands of ``sluiceway``: ``submit``, ``result``, ``status``, ``cancel``, ``bulk``, ``acl``.

They never import torch. ``sluiceway.cli`` mounts them (and ``acl``) beside the worker's and
the bench's commands; ``python -m producers.cli`` runs them alone. Every option can also come
from the environment: ``SLUICEWAY_REDIS_URL``, ``SLUICEWAY_PREFIX``, and
``SLUICEWAY_<COMMAND>_<OPTION>`` for the rest (e.g. ``SLUICEWAY_BULK_MAX_OUTSTANDING``).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from producers.acl import ROLES, setuser_line
from producers.bulk_input import MAX_INT_DIGITS, MAX_JSON_DEPTH, MAX_LINE_BYTES
from producers.jobs import DEFAULT_URL, URL_ENV
from producers.protocol import DEFAULT_PREFIX
from producers.protocol.keys import MAX_QUEUE_SHARDS, QUEUE_SHARDS_HELP, check_job_id
from producers.tool_parsers import PARSERS

EXIT_JOB_ENDED_BADLY = 1  # failed, cancelled, expired, unknown; bulk: some rows failed
EXIT_TIMEOUT = 3  # a wait ran out; the job (or bulk run) goes on and can be picked up again


def _keep_queue_shards(ctx: click.Context, _param: click.Parameter, value: int) -> int:
    ctx.meta["sluiceway.queue_shards"] = value
    return value


def redis_options(f: Callable) -> Callable:
    f = click.option("--queue-shards", type=click.IntRange(0, MAX_QUEUE_SHARDS), default=0, show_default=True,
                     envvar="SLUICEWAY_QUEUE_SHARDS", expose_value=False, callback=_keep_queue_shards,
                     help=QUEUE_SHARDS_HELP[0].upper() + QUEUE_SHARDS_HELP[1:] + ".")(f)
    f = click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="SLUICEWAY_PREFIX",
                     help="Key prefix shared with the workers.")(f)
    return click.option("--redis", "redis_url", default=DEFAULT_URL, show_default=True, envvar=URL_ENV,
                        help="Redis URL: redis://, rediss:// (TLS), unix://, redis+sentinel://, redis+cluster://host:port,host:port;"
                             " user and password as in redis://user:pw@host.")(f)


def _client(redis_url: str, prefix: str, queue: str = "interactive"):
    from producers.client import Client
    from producers.connection import UnsupportedServer

    ctx = click.get_current_context(silent=True)
    shards = ctx.meta.get("sluiceway.queue_shards", 0) if ctx is not None else 0
    from producers.errors import InvalidJob

    try:
        return Client(redis_url, prefix=prefix, queue=queue, queue_shards=shards)
    except UnsupportedServer as exc:
        raise click.ClickException(str(exc)) from None
    except InvalidJob as exc:  # the queue's name
        raise click.BadParameter(str(exc), param_hint="--queue") from None
    except ValueError as exc:  # a prefix the keys refuse, or a URL redis-py cannot open; the message names it
        raise click.UsageError(str(exc)) from None


def _json_arg(value: str | None, what: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=what) from None


def _token_ids(value: str | None) -> list[int] | None:
    if value is None:
        return None
    tokens = [t for t in value.replace(" ", "").split(",") if t]
    for token in tokens:
        if not token.removeprefix("-").isdecimal():
            raise click.BadParameter(f"{token!r} is not an integer (give comma-separated token ids)",
                                     param_hint="--token-ids")
    return [int(t) for t in tokens]


def _wait_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A wait's limit: seconds >= 0, checked before anything is submitted (NaN and negatives refused)."""
    if value is not None and not value >= 0:
        raise click.BadParameter(f"{value} is not a number of seconds >= 0", ctx=ctx, param=param)
    return value


def _job_ids(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Job ids (one, several, or none where optional) checked as the protocol checks them, so a
    malformed one is a usage error rather than an "unknown" job."""
    for job_id in (value if isinstance(value, tuple) else () if value is None else (value,)):
        try:
            check_job_id(job_id)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return value


def _job_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A job's time to live: seconds > 0 (0 or less would expire every job before it ran)."""
    if value is not None and not value > 0:
        raise click.BadParameter(f"{value} is not a number of seconds > 0", ctx=ctx, param=param)
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sluiceway")
def cli() -> None:
    """Sluiceway: LLM inference through Redis queues."""


@cli.command()
@click.argument("prompt", required=False)
@click.option("--messages", help='Chat messages as JSON, e.g. \'[{"role": "user", "content": "hi"}]\'.')
@click.option("--token-ids", help="Prompt token ids, comma-separated.")
@click.option("--sampling", help='Sampling parameters as JSON, e.g. \'{"temperature": 0, "max_tokens": 64}\'.')
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="One sampling parameter (VALUE read as JSON when it parses); repeatable.")
@click.option("--queue", default="interactive", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
@click.option("--deadline", type=float, help="Seconds from now (or a unix time) after which the job expires.")
@click.option("--metadata", help="A JSON object echoed back in the result.")
@click.option("--id", "job_id", help="The job's id (default: a random one). A known id is not enqueued again.")
@click.option("--wait", is_flag=True, help="Wait for the result and print its text.")
@click.option("--stream", is_flag=True, help="Stream the text as it is generated.")
@click.option("--json", "as_json", is_flag=True, help="With --wait: print the whole result as JSON.")
@click.option("--timeout", type=float, callback=_wait_seconds,
              help="With --wait or --stream: give up waiting after this many seconds.")
@redis_options
def submit(prompt, messages, token_ids, sampling, params, queue, priority, deadline, metadata, job_id,
           wait, stream, as_json, timeout, redis_url, prefix) -> None:
    """Submit one job and print its id (PROMPT '-' reads standard input)."""
    from producers.errors import InvalidJob

    if prompt == "-":
        prompt = sys.stdin.read()
    sampling_dict = _json_arg(sampling, "--sampling") or {}
    if not isinstance(sampling_dict, dict):
        raise click.BadParameter(f"must be a JSON object, got {sampling!r}", param_hint="--sampling")
    for param in params:
        key, sep, value = param.partition("=")
        if not sep:
            raise click.BadParameter(f"{param!r} is not KEY=VALUE", param_hint="--param")
        try:
            sampling_dict[key] = json.loads(value)
        except ValueError:
            sampling_dict[key] = value
    ids = _token_ids(token_ids)
    with _client(redis_url, prefix, queue) as client:
        try:
            job_id = client.submit(
                prompt, messages=_json_arg(messages, "--messages"), prompt_token_ids=ids, sampling=sampling_dict,
                priority=priority, deadline=deadline, metadata=_json_arg(metadata, "--metadata"),
                stream=stream, job_id=job_id,
            )
        except InvalidJob as exc:
            raise click.UsageError(str(exc)) from None
        if stream:
            click.echo(job_id, err=True)
            _guard(lambda: [click.echo(text, nl=False) for text in client.stream(job_id, timeout)])
            click.echo()
        elif wait:
            result = _guard(lambda: client.result(job_id, timeout))
            click.echo(result.model_dump_json() if as_json else result.text)
        else:
            click.echo(job_id)


@cli.command()
@click.argument("job_id", callback=_job_ids)
@click.option("--timeout", type=float, callback=_wait_seconds, help="Give up waiting after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
@redis_options
def result(job_id, timeout, as_json, redis_url, prefix) -> None:
    """Wait for a job to end and print its text."""
    with _client(redis_url, prefix) as client:
        done = _guard(lambda: client.result(job_id, timeout))
    click.echo(done.model_dump_json() if as_json else done.text)


@cli.command()
@click.argument("job_id", required=False, callback=_job_ids)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@redis_options
def status(job_id, as_json, redis_url, prefix) -> None:
    """Print a job's status, attempts, worker, times and error; without JOB_ID, the queues and workers."""
    with _client(redis_url, prefix) as client:
        if job_id is None:
            _overview(client, as_json)
            return
        info = _guard(lambda: client.status(job_id))
    if as_json:
        click.echo(info.model_dump_json())
        return
    click.echo(f"{info.id}  {info.status.value}  attempts={info.attempts}  worker={info.worker or '-'}"
               f"  queue={info.queue or '-'}")
    for name in ("enqueued_at", "started_at", "finished_at"):
        value = getattr(info, name)
        if value is not None:
            click.echo(f"  {name}: {value:.3f}")
    if info.error_code:
        click.echo(f"  error_code: {getattr(info.error_code, 'value', info.error_code)}")
    if info.error:
        click.echo(f"  error: {info.error}")


def _overview(client, as_json: bool) -> None:
    import dataclasses

    from redis.exceptions import NoPermissionError

    try:
        queues, fleet = client.queues(), client.fleet()
    except NoPermissionError as exc:
        raise click.ClickException(
            f"the overview lists queues with SCAN and XPENDING, which this Redis user may not run ({exc});"
            " run it as an operator (PROTOCOL.md, Security and ACLs)") from None
    # NOTE: a record that is no heartbeat is named and skipped, never fatal: one hand-written
    # field must not hide the rest of the fleet
    if as_json:
        overview = {"queues": [dataclasses.asdict(q) for q in queues.values()],
                    "workers": [{**w.info.model_dump(), "alive": w.fresh} for w in fleet.workers]}
        click.echo(json.dumps(overview | ({"unreadable": fleet.unreadable} if fleet.unreadable else {})))
        return
    click.echo("queues:" if queues else "queues: none yet")
    for q in queues.values():
        click.echo(f"  {q.name}: {q.backlog} not ended, {q.held} held by workers")
    click.echo("workers:" if fleet.workers else "workers: none")
    for worker in fleet.workers:
        w = worker.info
        state = w.state if worker.fresh else f"silent for {fleet.at - w.last_seen:.0f}s (dead?)"
        click.echo(f"  {w.name} ({w.host}, pid {w.pid}) {state}: model {w.model}, queues {','.join(w.queues)},"
                   f" {w.in_flight} in flight, room for {w.capacity}, {w.finished} finished")
    if fleet.unreadable:
        click.echo(f"not heartbeats (skipped): {', '.join(fleet.unreadable)} in {client.keys.workers}")


@cli.command()
@click.argument("job_ids", nargs=-1, required=True, callback=_job_ids)
@redis_options
def cancel(job_ids, redis_url, prefix) -> None:
    """Ask the workers to cancel jobs (queued or running)."""
    with _client(redis_url, prefix) as client:
        for job_id in job_ids:
            live = client.cancel(job_id)
            click.echo(f"{job_id}: {'cancel requested' if live else 'not queued or running (nothing to cancel)'}")


def _in_a_folder(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file's folder must exist: checked before any job is submitted, not when the first ends."""
    if value is not None:
        folder = Path(value).expanduser().absolute().parent
        if not folder.is_dir():
            raise click.BadParameter(f"the folder {str(folder)!r} does not exist", ctx=ctx, param=param)
    return value


@cli.command()
@click.argument("in_path", metavar="IN.jsonl", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path", metavar="OUT.jsonl", type=click.Path(dir_okay=False), callback=_in_a_folder)
@click.option("--queue", default="bulk", show_default=True)
@click.option("--max-outstanding", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Jobs in flight at once.")
@click.option("--retry-failed", is_flag=True,
              help="Resubmit failed, cancelled and expired rows (from OUT or this run) once, with a fresh id.")
@click.option("--timeout", type=float, callback=_wait_seconds,
              help="Stop after this many seconds, a wait for Redis to come back included (rows still"
                   " running are picked up by a re-run).")
@click.option("--job-timeout", type=float, callback=_job_seconds,
              help="Each job expires this many seconds after it is submitted.")
@click.option("--progress/--no-progress", default=True, show_default=True)
# NOTE: hidden: tests shrink it (SLUICEWAY_BULK_MAX_LINE_BYTES) to keep their files small; users
# get the documented 8 MiB, which holds any prompt a model's context can take.
@click.option("--max-line-bytes", type=click.IntRange(min=1), default=MAX_LINE_BYTES, hidden=True)
@click.option("--format", "file_format", type=click.Choice(["sluiceway", "openai"]), default="sluiceway",
              show_default=True, help="openai: IN is an OpenAI Batch API input file, OUT (and ERR) its output.")
@click.option("--errors", "err_path", type=click.Path(dir_okay=False), callback=_in_a_folder,
              help="--format openai: write error lines here rather than to OUT.")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="--format openai: a chat line with tools may leave the choice to the model (tool_choice auto),"
                   " its calls read by --tool-call-parser, as sluiceway serve's.")
@click.option("--tool-call-parser", type=click.Choice(list(PARSERS)),
              help="--format openai: how the model writes the calls of an auto tool choice.")
@redis_options
def bulk(in_path, out_path, queue, max_outstanding, retry_failed, timeout, job_timeout, progress,
         max_line_bytes, file_format, err_path, enable_auto_tool_choice, tool_call_parser, redis_url, prefix) -> None:
    """Run every job of IN.jsonl and write one result line per row to OUT.jsonl, in order.

    Re-running the same command resumes: rows already in OUT are kept, jobs already
    submitted are not submitted again. A row without an "id" gets one derived from a secret
    run key kept in OUT.jsonl.key (mode 0600): keep it to resume; without it, rows not yet in
    OUT start again under new ids.

    Lines are split on \\n only. A line that is not a job becomes an "invalid" row naming the
    problem and the rest run: bad UTF-8 or JSON, not an object, NaN or Infinity, a number
    over {digits:,} digits, nesting deeper than {depth} levels, or a line over {size} MiB. A job
    of a later protocol revision than every live worker of the queue speaks (tools to workers of
    1.2, during a rolling upgrade) is not submitted: its row is "failed", naming the field.

    With --format openai, IN holds OpenAI batch lines ({{"custom_id", "method", "url", "body"}},
    for /v1/chat/completions and /v1/completions; a completions line of several prompts is a
    job each and one answer) and OUT gets OpenAI batch output lines as their jobs end; invalid
    lines and failed jobs go to --errors ERR (default: OUT, as vLLM's run-batch does).
    Re-running resumes the same way, from the run key in OUT.jsonl.key.
    """
    from producers.bulk import Bulk, BulkError

    signal.signal(signal.SIGTERM, _interrupt)  # a kill ends like Ctrl-C: OUT stays consistent
    if file_format == "openai" and (retry_failed or job_timeout is not None):
        raise click.UsageError("--retry-failed and --job-timeout are not available with --format openai")
    if err_path is not None and file_format != "openai":
        raise click.UsageError("--errors goes with --format openai")
    if (enable_auto_tool_choice or tool_call_parser) and file_format != "openai":
        raise click.UsageError("--enable-auto-tool-choice and --tool-call-parser go with --format openai")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser")
    with _client(redis_url, prefix, queue) as client:
        if file_format == "openai":
            from producers.bulk_openai import OpenAIBulk

            run = OpenAIBulk(client, in_path, out_path, err_path, queue=queue, max_outstanding=max_outstanding,
                             max_line_bytes=max_line_bytes, timeout=timeout, progress=progress,
                             tool_parser=tool_call_parser if enable_auto_tool_choice else None)
        else:
            run = Bulk(client, in_path, out_path, queue=queue, max_outstanding=max_outstanding,
                       max_line_bytes=max_line_bytes, retry_failed=retry_failed, timeout=timeout,
                       job_deadline_s=job_timeout, progress=progress)
        try:
            summary = run.run()
        except BulkError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            click.echo(f"interrupted: {run.summary.line()}", err=True)
            sys.exit(130)
    click.echo(summary.line(), err=True)
    if not summary.complete:
        sys.exit(EXIT_TIMEOUT)
    if summary.failed or summary.invalid:
        sys.exit(EXIT_JOB_ENDED_BADLY)


bulk.help = bulk.help.format(depth=MAX_JSON_DEPTH, size=MAX_LINE_BYTES // 2**20, digits=MAX_INT_DIGITS)


@cli.command()
@click.argument("role", type=click.Choice(sorted(ROLES)))
@click.option("--password", prompt=True, hide_input=True, help="The user's password (printed only as its SHA-256).")
@click.option("--redis-version", "major", type=click.IntRange(min=6), default=7, show_default=True,
              help="Major version of the Redis server (6 has no per-key read/write rights).")
@click.option("--user", help="The ACL user name (default: the role's name).")
@click.option("--db", type=click.IntRange(min=0), default=0, show_default=True,
              help="The database the clients use (names Celery's mailbox channel).")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="SLUICEWAY_PREFIX",
              help="Key prefix shared by producers and workers.")
@click.option("--cluster", is_flag=True, help="The role on the cluster layout (--queue-shards over "
                                             "redis+cluster://): run the printed command on every master.")
def acl(role, password, major, user, db, prefix, cluster) -> None:
    """Print the ACL SETUSER command of a least-privilege ROLE, for redis-cli (PROTOCOL.md)."""
    try:
        click.echo(setuser_line(ROLES[role], prefix, major, password, user, db, cluster))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _guard(call: Callable[[], Any]) -> Any:
    """Run a client call; a job that ended badly or a wait that ran out exits with a message."""
    from producers.errors import SluicewayError, Timeout

    try:
        return call()
    except Timeout as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_TIMEOUT)
    except SluicewayError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_JOB_ENDED_BADLY)


def main() -> None:
    from redis.exceptions import ConnectionError as RedisUnreachable, TimeoutError as RedisTimeout

    try:
        cli(auto_envvar_prefix="SLUICEWAY")
    except (RedisUnreachable, RedisTimeout) as exc:  # as ``sluiceway`` says it: one line, no traceback
        click.echo(f"error: redis: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
