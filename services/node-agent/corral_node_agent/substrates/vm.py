"""The `vm` substrate: each sandbox is a full QEMU PC (q35: PCI, ACPI, firmware) with a kernel
of its own, for code that needs what a microvm leaves out (a PCI bus, ACPI, a real firmware
hand-off), at the cost of a slower boot.

Everything else is the microvm substrate's: the same guest (the distribution's kernel booted
through PVH, corral's initramfs and agent), the image's EROFS layers as read-only virtio block
devices, here on PCI, under an overlay on a tmpfs, the agent on a virtio-serial port, QEMU in the
sandbox's cgroup, KVM when a real boot under it passes, TCG otherwise; network none."""
from __future__ import annotations

from .microvm import MicrovmSubstrate


class VmSubstrate(MicrovmSubstrate):
    name = "vm"
    machine = "q35"
    virtio = "pci"
