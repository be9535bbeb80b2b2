"""Point clouds: partitioning over the domain ranks and exact neighbour search across parts.

``PointCloudPartition`` splits a cloud into spatially coherent, balanced parts (one per domain
rank) and restores per-point results; ``knn`` / ``radius`` find neighbours among the points of
all ranks (candidate blocks circulate on the domain ring); ``gather_neighbours`` fetches their
features with gradients; ``part.graph(edge_index)`` gives a rank's in-edges of a graph with the
halo points they reach (``HaloGraph``: graph network layers across parts). Points are on dim -2
everywhere: ``(N, C)`` or ``(B, N, C)``.
"""

from .graph import HaloGraph
from .knn import gather_neighbours, knn, radius, within_radius
from .partition import Ghosts, PointCloudPartition, balanced_sizes

__all__ = [
    "Ghosts", "HaloGraph", "PointCloudPartition", "balanced_sizes", "gather_neighbours", "knn", "radius",
    "within_radius",
]
