"""Gateway settings: every ``sluiceway serve`` flag, each also read from ``SLUICEWAY_<FLAG>``.

The same pydantic-settings pattern as the worker's (``worker/settings.py``), over the same
``RedisFields`` (``producers/service_settings.py``): flags given on the command line win over
the environment; ``SLUICEWAY_REDIS`` / ``SLUICEWAY_PREFIX`` / ``SLUICEWAY_QUEUE_SHARDS`` are
the names the worker reads, so one environment configures both sides.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from gateway.model_parsers import NO_PARSERS, ModelParsers, read_model_parsers
from producers.service_settings import ENV_PREFIX, RedisFields
from producers.tool_parsers import PARSERS

_NAMED_KEY = re.compile(r"^([A-Za-z0-9._-]{1,64})=(.+)$")
DEFAULT_TENANT = "default"  # the one tenant of a gateway without API keys
# NOTE: the longest wait a setting takes, in seconds (about 68 years): a request's deadline and
# its tenant record's EXPIRE take it, where inf made every request a 400 (its job's deadline)
# and 1e300 a 500 (the EXPIRE) under --max-outstanding
MAX_SECONDS = 2**31 - 1


class GatewaySettings(RedisFields):
    """Everything one gateway process needs; see ``sluiceway serve --help``."""

    model_config = SettingsConfigDict(allow_inf_nan=False)  # a float setting is a finite number

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    workers: int = Field(1, ge=1, description="gateway processes sharing the port (uvicorn workers); one Python"
                                            " process streams a few thousand chunks a second")
    api_key: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="accepted API keys, each a tenant: KEY (the tenant is named by the key's hash) or"
                        " NAME=KEY; repeat the flag, or comma-separate them in the environment; none: no"
                        " authentication, one tenant")
    max_backlog: int | None = Field(None, ge=0, description="answer 429 when the model's queue holds more jobs"
                                                            " than this (unset: no limit)")
    max_outstanding: int | None = Field(None, ge=1, description="requests one tenant may have unanswered at once,"
                                                                " over every gateway (unset: no limit)")
    tenant_max_outstanding: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="NAME=N: tenant NAME's own limit on unanswered requests, over --max-outstanding;"
                        " repeat the flag, or comma-separate them in the environment")
    request_timeout: float = Field(600.0, gt=0, le=MAX_SECONDS,
                                   description="seconds a request may wait for its job; then 504 and the job is"
                                               " cancelled")
    redis_max_connections: int = Field(4096, ge=8, description="Redis connections one gateway may open: each"
                                                                " request waiting on its job holds one")
    models_refresh_seconds: float = Field(1.0, ge=0, le=MAX_SECONDS,
                                         description="how long the list of live workers is cached")
    enable_auto_tool_choice: bool = Field(False, description="let a chat with tools leave the choice to the model"
                                                             " (tool_choice auto, the default with tools), its calls"
                                                             " read by --tool-call-parser; off, such a request is a"
                                                             " 400 (required and named tool choice work either way)")
    tool_call_parser: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="how the served models write the calls of an auto tool choice: PARSER for every model,"
                        " MODEL=PARSER for one model (its served name) over that; repeat the flag, or"
                        f" comma-separate them in the environment; the parsers: {', '.join(PARSERS)}")

    @field_validator("tool_call_parser")
    @classmethod
    def _check_parsers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        read_model_parsers(value)
        return value

    @model_validator(mode="after")
    def _auto_needs_a_parser(self) -> "GatewaySettings":
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(f"enable_auto_tool_choice needs --tool-call-parser ({', '.join(PARSERS)}): the"
                             " format the models write their calls in (PARSER for every model, MODEL=PARSER"
                             " for one)")
        return self

    @property
    def auto_tool_parsers(self) -> ModelParsers:
        """Each model's parser of an auto tool choice; none when it is not enabled."""
        return read_model_parsers(self.tool_call_parser) if self.enable_auto_tool_choice else NO_PARSERS

    @field_validator("api_key", "tenant_max_outstanding", "tool_call_parser", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("api_key")
    @classmethod
    def _check_keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for key in value:
            if not key or any(c.isspace() for c in key):
                raise ValueError("api_key: each key must be a non-empty word without spaces")
        named: dict[str, str] = {}  # key -> tenant
        for key, tenant in map(tenant_of_key, value):
            # NOTE: one key given twice to one tenant is harmless; to two, the last silently took it
            if named.get(key, tenant) != tenant:
                raise ValueError(f"api_key: one key is given to two tenants, {named[key]} and {tenant}")
            named[key] = tenant
        tenants = list(named.values())
        if len(set(tenants)) != len(tenants):
            raise ValueError("api_key: two keys name the same tenant")
        return value

    @field_validator("tenant_max_outstanding")
    @classmethod
    def _check_tenant_limits(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for spec in value:
            name, _, limit = spec.partition("=")
            if not _NAMED_KEY.match(f"{name}=x") or not limit.isdigit() or int(limit) < 1:
                raise ValueError(f"tenant_max_outstanding: {spec!r} must be NAME=N with N >= 1")
        if "api_key" not in info.data:  # refused itself: said already
            return value
        # NOTE: a limit for a tenant no key names (a typo) was silently no limit at all
        tenants = sorted({tenant for _, tenant in map(tenant_of_key, info.data["api_key"])})
        known = (f"the tenants of --api-key: {', '.join(tenants)}" if tenants
                 else f"without --api-key the one tenant is {DEFAULT_TENANT}")
        names = [spec.partition("=")[0] for spec in value]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"tenant_max_outstanding: tenant {name} is given two limits")
            if name not in (tenants or [DEFAULT_TENANT]):
                raise ValueError(f"tenant_max_outstanding: {name!r} names no tenant ({known})")
        return value

    def outstanding_limit(self, tenant: str) -> int | None:
        """How many unanswered requests ``tenant`` may have (None: no limit)."""
        for spec in self.tenant_max_outstanding:
            name, _, limit = spec.partition("=")
            if name == tenant:
                return int(limit)
        return self.max_outstanding

    def to_environment(self) -> dict[str, str]:
        """These settings as ``SLUICEWAY_*`` variables, which rebuild them in another process."""
        env = {}
        for name, value in self.model_dump().items():
            if value is not None:
                env[ENV_PREFIX + name.upper()] = ",".join(value) if isinstance(value, tuple) else str(value)
        return env

    @property
    def tenants(self) -> dict[str, str]:
        """API key -> tenant name."""
        return dict(tenant_of_key(k) for k in self.api_key)


def tenant_of_key(spec: str) -> tuple[str, str]:
    """``(key, tenant)`` of one ``--api-key`` value: ``NAME=KEY``, or a bare key named by its hash."""
    named = _NAMED_KEY.match(spec)
    if named:
        return named.group(2), named.group(1)
    # NOTE: a bare key's tenant is a digest, so the key itself never reaches Redis or a log line
    return spec, "key-" + hashlib.sha256(spec.encode()).hexdigest()[:16]
