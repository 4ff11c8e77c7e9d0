"""``/v1/files``: upload, list, read and delete the files of the Batch API, per tenant.

Uploads are multipart (``file``, ``purpose=batch``, and optionally ``expires_after[anchor]`` and
``expires_after[seconds]``), as the OpenAI SDK sends them. Where the bytes go and the limits:
``gateway/batch_store.py`` and ``BatchSettings``; the expiry: ``gateway/file_expiry.py``; deletes:
``gateway/file_removal.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from gateway.batch_service import batches_of
from gateway.batch_records import LINES, file_object
from gateway.errors import APIError, InvalidRequest
from gateway.file_expiry import expiry_seconds, form_expiry
from gateway.state import tenant_of
from gateway.tenants import Tenant

router = APIRouter()
FORM_SLACK = 64 * 1024  # multipart framing and the purpose field, beyond the file's own bytes


@router.post("/v1/files")
async def create_file(request: Request, tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    service = batches_of(request)
    settings = service.settings
    largest = max(settings.max_file_bytes, settings.max_dir_file_bytes if settings.files_dir else 0)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > largest + FORM_SLACK:
        raise APIError(413, f"file: the upload is {int(length):,} bytes; the limit is {largest:,} bytes"
                            " (SLUICEWAY_BATCH_MAX_FILE_BYTES, or SLUICEWAY_BATCH_MAX_DIR_FILE_BYTES with"
                            " SLUICEWAY_BATCH_FILES_DIR)", param="file", code="file_too_large")
    async with request.form(max_files=1, max_fields=4) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise InvalidRequest("file", "file: missing; send the file as the multipart field 'file'")
        if not isinstance(purpose, str):
            raise InvalidRequest("purpose", "purpose: missing; it must be 'batch'")
        expires_after = expiry_seconds("expires_after", form_expiry(form))
        return await service.store.put_upload(tenant.name, upload.filename or "upload.jsonl", purpose, upload.file,
                                              expires_after)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, limit: int = Query(10_000, ge=1, le=10_000),
                     after: str | None = None, order: Literal["asc", "desc"] = "desc",
                     tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    return await batches_of(request).store.list_files(tenant.name, purpose, limit, after, order)


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str, tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    store = batches_of(request).store
    return file_object(await store.file_meta(tenant.name, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str, tenant: Tenant = Depends(tenant_of)) -> StreamingResponse:
    store = batches_of(request).store
    meta = await store.file_meta(tenant.name, file_id)
    # NOTE: an output file's size is counted as its lines are written; only an upload's is exact
    # enough to promise in Content-Length.
    headers = {"Content-Length": meta["bytes"]} if meta["storage"] != LINES else {}
    return StreamingResponse(store.content(meta), media_type="application/octet-stream", headers=headers)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str, tenant: Tenant = Depends(tenant_of)) -> dict[str, Any]:
    service = batches_of(request)
    await service.removal.deletable_meta(tenant.name, file_id)  # 404 before anything else
    batch_id = await service.removal.running_batch_of(file_id)
    if batch_id is not None:
        raise APIError(409, f"file {file_id} is the input of batch {batch_id}, which is still running; cancel it or"
                            " wait for its end first", param="file_id", code="file_in_use")
    return await service.removal.delete_file(tenant.name, file_id)
