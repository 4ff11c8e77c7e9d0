"""Settings of the Batch API (``/v1/files``, ``/v1/batches``), each also read from ``SLUICEWAY_BATCH_<NAME>``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MIB = 2**20


class BatchSettings(BaseSettings):
    """Limits and pacing of files and batches; the defaults suit one Redis of a few GiB."""

    model_config = SettingsConfigDict(env_prefix="SLUICEWAY_BATCH_", extra="forbid")

    # NOTE: a file kept in Redis costs its size in Redis memory for as long as it lives; 100 MiB
    # holds ~100,000 chat requests of a few hundred tokens. Larger files need files_dir.
    max_file_bytes: int = Field(100 * MIB, ge=1, description="largest upload kept in Redis")
    files_dir: str | None = Field(None, description="a directory every gateway shares (NFS, a volume) for"
                                                    " uploads over max_file_bytes; unset: those are refused")
    max_dir_file_bytes: int = Field(2048 * MIB, ge=1, description="largest upload kept in files_dir")
    max_files_per_tenant: int = Field(10_000, ge=1, description="files one tenant may hold at once")
    # NOTE: OpenAI's default: a file of purpose batch expires 30 days after its upload unless its
    # expires_after says otherwise (other purposes stay until deleted)
    default_expires_after: int = Field(30 * 24 * 3600, ge=0, description="seconds after which an upload sent"
                                                                         " without expires_after expires; 0: it"
                                                                         " stays until deleted")
    lease_seconds: float = Field(10.0, gt=0, description="how long a batch stays with a gateway that stopped"
                                                         " renewing its lease (kill -9) before another takes it")
    max_outstanding: int = Field(1000, ge=1, description="jobs of one batch in flight at once")
    queue: str = Field("bulk", description="the queue batch jobs are fed to")
    poll_seconds: float = Field(0.25, gt=0, description="how often a feeder collects ended jobs and looks for"
                                                        " batches without a gateway")
    # NOTE: without files_dir a batch's output and error lines stay in Redis until it ends (about
    # 0.5 KB a row plus its text): 100,000 rows of short answers hold ~50-100 MiB. A larger
    # file is refused at validation (failed, too_many_rows); with files_dir there is no bound.
    max_rows_in_redis: int = Field(100_000, ge=1, description="most rows of a batch whose answers are kept in"
                                                               " Redis (no files_dir)")
    max_line_bytes: int = Field(8 * MIB, ge=1, description="longest input line; a longer one is an error line")
