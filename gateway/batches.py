"""``/v1/batches``: create, list, retrieve and cancel batches of the OpenAI Batch API, per tenant.

A batch is created ``validating`` and then belongs to whichever gateway holds its lease
(``gateway/batch_feeder.py``); these routes only read its hash and record a cancel, which
the feeder carries out (``cancelling`` -> ``cancelled``).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.batch_feeder import EXPIRING
from gateway.batch_service import batches_of
from gateway.batch_records import batch_object
from gateway.batch_store import new_id
from gateway.errors import APIError, InvalidRequest, invalid_value, sendable, validation_error
from gateway.file_expiry import expiry_seconds
from gateway.request_body import json_body
from gateway.state import tenant_of
from gateway.tenants import Tenant
from gateway.translate import ENDPOINTS
from producers.protocol.limits import abbreviate
from producers.protocol.batch_statuses import BatchStatus

router = APIRouter()
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 24 * 3600
MAX_METADATA_PAIRS = 16  # OpenAI's limits on a batch's metadata
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None)
    # NOTE: loose, checked by expiry_seconds: its message names the field and the limit
    output_expires_after: Any = None


def create_body(body: Any) -> CreateBatch:
    """The body as a ``CreateBatch``, or a 400 naming the field at fault (FastAPI's own reading named
    none for an empty body, an integer too long to read, or an unknown field "" or with a lone surrogate)."""
    if not isinstance(body, dict):
        raise InvalidRequest(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(CreateBatch.model_fields))
    if unknown:
        raise InvalidRequest(unknown[0], f"unrecognized request argument supplied: {abbreviate(unknown[0])}",
                             code="unknown_parameter")
    try:
        return CreateBatch.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def window_seconds(window: str) -> int:
    """``24h``, ``90m``, ``30s`` -> seconds; OpenAI takes only ``24h``, this server any up to a week."""
    found = _WINDOW.match(window)
    seconds = int(found.group(1)) * _UNIT_S[found.group(2)] if found else 0
    if not found or seconds > MAX_WINDOW_S:
        raise invalid_value("completion_window", window, "must be a duration such as 24h, 90m or 30s, at most 168h")
    return seconds


def check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's limits, the message naming the pair that breaks one (not the whole mapping)."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest("metadata", f"metadata: {len(metadata)} pairs; the limit is {MAX_METADATA_PAIRS}",
                             code="invalid_value")
    for key, value in metadata.items():
        # NOTE: a lone surrogate (a JSON escape) cannot be answered in UTF-8: the batch was stored, then its
        # answer failed (a 500, and a retry made a second batch)
        if sendable(key) != key:
            raise InvalidRequest("metadata", f"metadata: the key {abbreviate(key)} holds a lone UTF-16 surrogate;"
                                             " keys and values must be valid Unicode", code="invalid_value")
        if sendable(value) != value:
            raise InvalidRequest(f"metadata.{key}", f"metadata.{key}: {abbreviate(value)} holds a lone UTF-16"
                                                    " surrogate; keys and values must be valid Unicode",
                                 code="invalid_value")
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest("metadata", f"metadata: the key {abbreviate(key)} is {len(key)} characters; the"
                                             f" limit is {MAX_METADATA_KEY}", code="invalid_value")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata.{key}", f"metadata.{key}: the value is {len(value)} characters; the"
                                                    f" limit is {MAX_METADATA_VALUE}", code="invalid_value")


@router.post("/v1/batches")
async def create_batch(request: Request, tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    body = create_body(await json_body(request))
    service = batches_of(request)
    if body.endpoint not in ENDPOINTS:
        raise invalid_value("endpoint", body.endpoint, f"must be one of {', '.join(ENDPOINTS)}")
    window = window_seconds(body.completion_window)
    check_metadata(body.metadata or {})
    output_expires_after = expiry_seconds("output_expires_after", body.output_expires_after)
    file_meta = await service.store.file_meta(tenant.name, body.input_file_id)
    if file_meta.get("purpose") != "batch":
        raise InvalidRequest("input_file_id", f"input_file_id: {body.input_file_id} has purpose"
                             f" {file_meta.get('purpose')!r}; a batch reads a file of purpose 'batch'")
    keys = service.store.keys
    batch_id = new_id("batch").replace("-", "_")
    now = time.time()
    fields = {"id": batch_id, "tenant": tenant.name, "status": BatchStatus.VALIDATING.value, "endpoint": body.endpoint,
              "input_file_id": body.input_file_id, "completion_window": body.completion_window,
              "created_at": now, "expires_at": now + window, "total": 0, "completed": 0, "failed": 0,
              "metadata": json.dumps(body.metadata) if body.metadata is not None else "",
              "output_expires_after": output_expires_after if output_expires_after is not None else ""}
    async with service.redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.batch(batch_id), mapping=fields)
        pipe.hset(keys.file(body.input_file_id), "batch", batch_id)
        pipe.zadd(keys.batches(tenant.name), {batch_id: now})
        pipe.sadd(keys.active, batch_id)
        await pipe.execute()
    return batch_object({k: str(v) for k, v in fields.items()})


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                       tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    return await batches_of(request).store.list_batches(tenant.name, limit, after)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str, tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    return batch_object(await batches_of(request).store.batch_meta(tenant.name, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str, tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    """Stop feeding the batch and cancel its jobs in flight; the lines already answered stay.
    A batch already cancelling is answered as it is; one finalizing or ended is a 409, as
    OpenAI answers it (a client waiting for ``cancelled`` would wait for ever), and so is one
    past its completion window, which ends ``expired`` (a batch that has expired cannot be
    cancelled)."""
    service = batches_of(request)
    await service.store.batch_meta(tenant.name, batch_id)
    moved = await service.feeder.cancel(batch_id)
    meta = await service.store.batch_meta(tenant.name, batch_id)
    if moved == EXPIRING:
        raise APIError(409, f"Cannot cancel a batch that has expired: batch {batch_id} passed its completion window"
                            f" ({meta['completion_window']}) and ends 'expired' (status {meta['status']!r} until its"
                            " jobs in flight are cancelled)", param="batch_id", code="batch_not_cancellable")
    # NOTE: the move's answer, not the status read after it: the feeder may end a batch just
    # cancelled before this read, and that cancel still succeeded
    if not moved and meta["status"] != BatchStatus.CANCELLING.value:
        raise APIError(409, f"Cannot cancel a batch with status {meta['status']!r}: batch {batch_id} can be cancelled"
                            " only while validating or in_progress", param="batch_id", code="batch_not_cancellable")
    return batch_object(meta)
