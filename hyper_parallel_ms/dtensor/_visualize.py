"""visualize_sharding: a text table of which rank holds which slice of a DTensor.

Example (4 ranks, mesh (2, 2), placements (S(0), S(1)), global shape (4, 6))::

    mesh coord  rank  local shape  global slice
    (0, 0)         0  (2, 3)       [0:2, 0:3]
    (0, 1)         1  (2, 3)       [0:2, 3:6]
    ...
"""
from __future__ import annotations

from ._dtensor import DTensor

__all__ = ["visualize_sharding"]


def sharding_table(dtensor: DTensor) -> str:
    """The table as a string (pure: computed from the layout, no communication).

    Args:
        dtensor: the DTensor to describe.

    Example::

        print(sharding_table(dt))      # one row per rank: mesh coordinate, local shape, global slice
    """
    spec = dtensor.spec
    ranks = spec.mesh.mesh
    partial = [f"{p}@{a}" for a, p in enumerate(spec.placements) if p.is_partial()]
    head = (f"DTensor {spec.shape} placements ({', '.join(str(p) for p in spec.placements)}) "
            f"on mesh {spec.mesh.shape}" + (f"; partial values on mesh dims {', '.join(partial)}" if partial else ""))
    rows = [head, f"{'mesh coord':<14}{'rank':>5}  {'local shape':<16}global slice"]
    for coord in spec.layout.coordinates():
        slices = spec.layout.local_slices(spec.shape, coord)
        text = "[" + ", ".join(f"{s.start}:{s.stop}" for s in slices) + "]"
        shape = spec.layout.local_shape(spec.shape, coord)
        rows.append(f"{str(coord):<14}{int(ranks[coord]):>5}  {str(shape):<16}{text}")
    return "\n".join(rows)


def visualize_sharding(dtensor: DTensor, *, header: str = "") -> str:
    """Print (and return) which rank holds which slice of ``dtensor``.

    Args:
        dtensor: the DTensor to describe.
        header: a line printed above the table.

    Example::

        visualize_sharding(dt, header="weight")
    """
    text = (header + "\n" if header else "") + sharding_table(dtensor)
    print(text)
    return text
