"""The topology admin API under /admin, behind a bearer token.

GET  /admin/topology  {"policy", "instances": [row, ...]} (rows: pool.Instance.summary)
GET  /admin/capacity  the same rows after a fresh poll of every instance
POST /admin/add       {"role": "prefill" | "decode", "url"} -> the new row (polled at once); 403 for a
                      host outside the allowed instance hosts (nothing is sent to it) or an
                      instance that answers without proving it holds the internal token
                      (router/instance_auth.py; it is not added); an unreachable one is added
                      unhealthy
POST /admin/remove    {"url"} -> the removed row; its running requests finish
POST /admin/drain     {"url"} -> the row; no new requests go to it, running ones finish
POST /admin/undrain   {"url"} -> the row; it takes requests again
POST /admin/flush     {"url"} -> the row (polled after) + "flushed_tokens": the instance drops its
                      prefix cache's unreferenced pages (POST /flush_cache), the router its model of it

Without a configured token (--admin-token / PDSERVE_ADMIN_TOKEN) every route answers 404; with
one, a missing or wrong `Authorization: Bearer <token>` gets 401.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from ..contracts import FlushReply
from .protocol import ApiError


class AddBody(BaseModel):
    role: str
    url: str


class UrlBody(BaseModel):
    url: str


def admin_router(token: str | None) -> APIRouter:
    def authorize(request: Request) -> None:
        if token is None:
            raise ApiError(
                404,
                "the admin API is disabled: start the router with --admin-token or PDSERVE_ADMIN_TOKEN",
                code="admin_disabled",
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(
                401,
                "missing or wrong admin token (Authorization: Bearer <token>)",
                code="invalid_admin_token",
                type_="authentication_error",
            )

    router = APIRouter(prefix="/admin", dependencies=[Depends(authorize)])

    def pool(request: Request):
        return request.app.state.router.pool

    def topology_of(request: Request) -> dict:
        p = pool(request)
        return {"policy": p.policy, "instances": [i.summary() for i in p.instances.values()]}

    @router.get("/topology")
    def topology(request: Request):
        return topology_of(request)

    @router.get("/capacity")
    async def capacity(request: Request):
        await pool(request).poll_all(request.app.state.router.client)
        return topology_of(request)

    @router.post("/add")
    async def add(body: AddBody, request: Request):
        p = pool(request)
        try:
            inst = p.candidate(body.role, body.url)  # a URL a client can connect to, not yet added
        except ValueError as e:
            raise ApiError(400, str(e), "url") from None
        try:
            p.allowed.check(inst.url)  # before anything is sent to it
        except ValueError as e:
            raise ApiError(403, str(e), "url", "host_not_allowed") from None
        await p.poll(request.app.state.router.client, inst)  # before the pool's health loop sees it
        if inst.proven is False:  # it answered, without proving it holds the internal token
            raise ApiError(403, f"not added: {inst.error}", "url", "instance_not_proven")
        try:
            return p.admit(inst).summary()
        except ValueError as e:
            raise ApiError(400, str(e), "url") from None

    @router.post("/remove")
    def remove(body: UrlBody, request: Request):
        return _lookup(pool(request).remove, body.url).summary()

    @router.post("/drain")
    def drain(body: UrlBody, request: Request):
        inst = _lookup(pool(request).get, body.url)
        inst.draining = True
        return inst.summary()

    @router.post("/undrain")
    def undrain(body: UrlBody, request: Request):
        inst = _lookup(pool(request).get, body.url)
        inst.draining = False
        return inst.summary()

    @router.post("/flush")
    async def flush(body: UrlBody, request: Request):
        inst, client = _lookup(pool(request).get, body.url), request.app.state.router.client
        try:
            r = await client.post(f"{inst.url}/flush_cache", timeout=30)
            r.raise_for_status()
            flushed = FlushReply.model_validate_json(r.content).flushed_tokens
        except Exception as e:  # unreachable, an error answer, or not the contract
            raise ApiError(502, f"flush of {inst.url} failed: {type(e).__name__}: {e}"[:500]) from None
        if pool(request).cache_aware is not None:
            pool(request).cache_aware.forget(inst.url)
        await pool(request).poll(client, inst)
        return {**inst.summary(), "flushed_tokens": flushed}

    return router


def _lookup(fn, url: str):
    try:
        return fn(url)
    except KeyError:
        raise ApiError(404, f"no instance {url} in the topology", "url", "instance_not_found") from None
