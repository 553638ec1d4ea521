"""corral SDK: sandboxes for agents, over the NATS bus.

    async with await AsyncClient.connect() as client:
        async with await client.create(image="debian") as sb:
            r = await sb.exec("python3 -c 'print(6*7)'")
"""
from corral_common.contract.errors import (
    Capacity,
    Conflict,
    CorralError,
    Forbidden,
    Internal,
    InvalidRequest,
    NotFound,
    Timeout,
    Unavailable,
)
from corral_common.contract.messages import ExecChunk, ExecResult, SandboxInfo, SandboxSpec

from .client import AsyncClient, AsyncSandbox
from .functions import RemoteError
from .sync import Client, Sandbox

__all__ = [
    "AsyncClient", "AsyncSandbox", "Client", "Sandbox", "ExecResult", "ExecChunk", "SandboxInfo", "SandboxSpec",
    "RemoteError", "CorralError", "InvalidRequest", "NotFound", "Capacity", "Timeout", "Conflict", "Forbidden", "Unavailable", "Internal",
]
