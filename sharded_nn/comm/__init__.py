"""Communication: the only part of sharded_nn that calls collectives.

Functions and ``torch.autograd.Function``s, no ``nn.Module``s. Layers plan *what* to exchange
from layouts; this package moves the bytes.
"""

from .collectives import all_gather_grid, all_gather_uneven, all_reduce_max, all_reduce_sum, scatter_uneven
from .halo import HaloGather, HaloHandle, HaloSpec, halo_cat, halo_exchange, halo_gather, halo_scatter
from .peers import AxisPeers, axis_peers, comm_device, domain_peers
from .sizes import gather_layouts, layouts_from_shapes, metadata_group

#: Deprecated aliases (kept so that existing code runs): ``AxisPeers`` serves open halo chains as
#: well as rings, hence the new names.
from .peers import AxisRing, axis_ring, domain_ring  # noqa: E402

__all__ = [
    "AxisPeers",
    "AxisRing",
    "HaloGather",
    "HaloHandle",
    "HaloSpec",
    "all_gather_grid",
    "all_gather_uneven",
    "all_reduce_max",
    "all_reduce_sum",
    "axis_peers",
    "axis_ring",
    "comm_device",
    "domain_peers",
    "domain_ring",
    "gather_layouts",
    "halo_cat",
    "halo_exchange",
    "halo_gather",
    "halo_scatter",
    "layouts_from_shapes",
    "metadata_group",
    "scatter_uneven",
]
from .all_to_all import heads_to_seq, seq_to_heads, transpose_shards
from .ring_pass import RingHandle, gather_ints, ring_pass

__all__ += ["RingHandle", "gather_ints", "heads_to_seq", "ring_pass", "seq_to_heads", "transpose_shards"]
from .halo_add import halo_add

__all__ += ["halo_add"]
from .rebalance import move_rows

__all__ += ["move_rows"]
