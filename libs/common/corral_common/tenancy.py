"""Which tenant sent a request, as the NATS server says, never as the request says.

Tenants are users of the TENANTS account, which imports the public subjects (`corral.v1.>`) from
the CORRAL account with `share`: the server adds a `Nats-Request-Info` header naming the account
and the user to every request that crosses over, and overwrites one a client sets itself (verified
on nats-server 2.15). Each tenant may publish only requests and subscribe only to its own inboxes
(`_INBOX.<name>.>`), so tenants never see each other's traffic. (One shared account, not one per
tenant: an account added by a configuration reload did not get its service import wired on this
server version, while users added to an existing account did, every time.) Requests from inside
the CORRAL account (the operator and corral's own services) carry no such header: trusted.
"""
from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg

from .contract.errors import Forbidden

T = TypeVar("T")
REQUEST_INFO = "Nats-Request-Info"
ACCOUNT = "TENANTS"
NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")  # a tenant's name: its user in the TENANTS account


def inbox_prefix(name: str) -> str:
    """Where a tenant's replies arrive (the only subjects it may subscribe to)."""
    return f"_INBOX.{name}"


def caller(msg: Msg) -> str | None:
    """The tenant whose connection sent `msg`, or None for the operator and corral's services.
    A request that crossed from anywhere else is refused (fail closed)."""
    raw = (msg.headers or {}).get(REQUEST_INFO)
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        acc, name = info.get("acc", ""), info.get("user", "")
    except (ValueError, AttributeError):
        acc = name = ""
    if acc != ACCOUNT or not isinstance(name, str) or not NAME.match(name):
        raise Forbidden(f"request from an unknown account or user ({acc!r}, {name!r})")
    return name


def qualify_job(who: str | None, job: str) -> str:
    """A tenant's job names live under its own name ("alice/train"), so quotas, fair share and
    listing by job never mix two tenants' jobs; the operator's are as given."""
    if who is None:
        return job
    return f"{who}/{job}" if job else who


def check_owner(who: str | None, owner: str, what: str) -> None:
    """Forbidden unless `who` (a tenant, or None for the operator) may act on `what` of `owner`."""
    if who is not None and who != owner:
        raise Forbidden(f"{what} belongs to another tenant")


def operator_only(who: str | None, what: str) -> None:
    if who is not None:
        raise Forbidden(f"{what} is for the operator, not for tenants")


def for_operator(handler: Callable[[Msg], Awaitable[T]], what: str) -> Callable[[Msg], Awaitable[T]]:
    """`handler`, refusing tenants (Forbidden) before it reads the request."""
    async def checked(msg: Msg) -> T:
        operator_only(caller(msg), what)
        return await handler(msg)

    return checked
