"""Substrate registry: adding a substrate is one module and one entry here."""
from __future__ import annotations

from .base import Substrate
from .container import ContainerSubstrate
from .docker import DockerSubstrate
from .function import FunctionSubstrate
from .gvisor import GvisorSubstrate
from .microvm import MicrovmSubstrate
from .vm import VmSubstrate

REGISTRY: dict[str, type[Substrate]] = {
    ContainerSubstrate.name: ContainerSubstrate,
    FunctionSubstrate.name: FunctionSubstrate,
    DockerSubstrate.name: DockerSubstrate,
    GvisorSubstrate.name: GvisorSubstrate,
    MicrovmSubstrate.name: MicrovmSubstrate,
    VmSubstrate.name: VmSubstrate,
}

__all__ = ["REGISTRY", "Substrate"]
