"""``GET /v1/models``: the models live workers serve (``gateway/models.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from gateway.state import gateway_of, tenant_of
from gateway.tenants import Tenant

router = APIRouter()
OWNER = "sluiceway"


def model_object(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": OWNER}


@router.get("/v1/models")
async def list_models(request: Request, _tenant: Tenant = Depends(tenant_of)) -> dict:
    models = await gateway_of(request).models.models()
    return {"object": "list", "data": [model_object(m.name, m.created) for m in models.values() if m.live]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request, _tenant: Tenant = Depends(tenant_of)) -> dict:
    model = await gateway_of(request).models.serving(name)
    return model_object(model.name, model.created)
