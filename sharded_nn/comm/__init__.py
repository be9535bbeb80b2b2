"""Communication: the only part of sharded_nn that calls collectives.

Functions and ``torch.autograd.Function``s, no ``nn.Module``s. Layers plan *what* to exchange
from layouts; this package moves the bytes.
"""

from .collectives import all_gather_grid, all_gather_uneven, all_reduce_max, all_reduce_sum, scatter_uneven
from .halo import HaloHandle, HaloSpec, halo_cat, halo_exchange
from .ring import AxisRing, axis_ring, comm_device
from .sizes import gather_layouts, layouts_from_shapes

__all__ = [
    "AxisRing",
    "HaloHandle",
    "HaloSpec",
    "all_gather_grid",
    "all_gather_uneven",
    "all_reduce_max",
    "all_reduce_sum",
    "axis_ring",
    "comm_device",
    "gather_layouts",
    "halo_cat",
    "halo_exchange",
    "layouts_from_shapes",
    "scatter_uneven",
]
from .all_to_all import heads_to_seq, seq_to_heads
from .ring_pass import RingHandle, domain_ring, gather_ints, ring_pass

__all__ += ["RingHandle", "domain_ring", "gather_ints", "heads_to_seq", "ring_pass", "seq_to_heads"]
from .halo_add import halo_add

__all__ += ["halo_add"]
