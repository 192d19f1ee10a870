"""Attempts at one request: each call the router makes for it (first try, retry, migration)
runs under a random id of the server's, so that nothing a client sends names, cancels or
collides with another request's engine, lease or stream state."""

from __future__ import annotations

import uuid
from dataclasses import replace

from cluster.request import Request


def new_request_id() -> str:
    """An id for one attempt at a request: random, never the client's."""
    return uuid.uuid4().hex


def retry_of(request: Request) -> Request:
    """`request` as a new attempt: the same generation under a fresh id."""
    return replace(request, request_id=new_request_id())


def resume_of(request: Request, done: list[int]) -> Request:
    """`request` as a new attempt, to go on after the tokens `done` the client already has."""
    return replace(request, output_token_ids=tuple(done), request_id=new_request_id())
