"""Deprecated module: ``AxisRing`` / ``axis_ring`` are now ``AxisPeers`` / ``axis_peers`` in ``peers.py``."""

from .peers import AxisPeers, AxisRing, axis_peers, axis_ring, comm_device

__all__ = ["AxisPeers", "AxisRing", "axis_peers", "axis_ring", "comm_device"]
