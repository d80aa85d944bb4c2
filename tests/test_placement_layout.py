"""Placements and Layout (pure Python): value semantics, and local shapes / offsets for
even, uneven, nested (several mesh dims on one tensor dim) and aliased layouts against a
brute-force torch.chunk simulation."""
from __future__ import annotations

import itertools
import pickle
import random
import types

import pytest

from hyper_parallel_ms.layout import Layout, chunk_offsets, chunk_sizes
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing.collective_check import chunk_bounds


def test_placement_values():
    assert [str(p) for p in (Shard(0), Shard(-1), Replicate(), Partial(), Partial("max"))] == \
        ["S(0)", "S(-1)", "R", "P(sum)", "P(max)"]
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Replicate() == Replicate()
    assert Partial("avg") != Partial("sum") and Partial() == Partial("sum")
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("min")}) == 4
    assert Shard(2).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1)
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("min").is_partial("min") and not Partial("min").is_partial("sum")
    for p in (Shard(3), Replicate(), Partial("avg")):
        assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(AttributeError):
        Shard(0).dim = 1
    with pytest.raises(TypeError, match="int tensor dimension"):
        Shard(1.0)
    with pytest.raises(TypeError):
        Shard(True)
    with pytest.raises(ValueError, match=r"Partial\(reduce_op\) must be one of"):
        Partial("prod")


def test_chunk_sizes_follow_torch_chunk():
    assert chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert chunk_sizes(6, 4) == (2, 2, 2, 0)
    assert chunk_sizes(0, 3) == (0, 0, 0)
    for size in range(0, 13):
        for n in range(1, 6):
            bounds = chunk_bounds(size, n)
            assert chunk_sizes(size, n) == tuple(b - a for a, b in bounds)
            assert sum(chunk_sizes(size, n)) == size
            for (a, b), off, s in zip(bounds, chunk_offsets(size, n), chunk_sizes(size, n)):
                if s:
                    assert off == a


def _brute_force(mesh_shape, placements, order, shape, coord):
    """Global indices held at ``coord`` per tensor dim, by splitting index lists."""
    held = []
    for dim, size in enumerate(shape):
        idx = list(range(size))
        axes = order.get(dim) or [a for a, p in enumerate(placements)
                                  if p.is_shard() and p.dim % len(shape) == dim]
        for axis in axes:
            n = mesh_shape[axis]
            step = -(-len(idx) // n)
            idx = idx[coord[axis] * step:(coord[axis] + 1) * step]
        held.append(idx)
    return held


def _random_layouts(rng, count):
    meshes = [(4,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2), (1, 4)]
    for _ in range(count):
        mesh = rng.choice(meshes)
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(0, 9) for _ in range(ndim))
        placements = []
        for _axis in mesh:
            kind = rng.random()
            if kind < 0.6:
                d = rng.randint(-ndim, ndim - 1)
                placements.append(Shard(d))
            elif kind < 0.8:
                placements.append(Replicate())
            else:
                placements.append(Partial(rng.choice(["sum", "avg", "max", "min"])))
        order = {}
        for dim in range(ndim):
            axes = [a for a, p in enumerate(placements) if p.is_shard() and p.dim % ndim == dim]
            if len(axes) > 1 and rng.random() < 0.5:
                rng.shuffle(axes)
                order[dim] = tuple(axes)
        yield mesh, tuple(placements), order, shape


def test_layout_matches_brute_force():
    rng = random.Random(1234)
    checked = 0
    for mesh, placements, order, shape in _random_layouts(rng, 600):
        lay = Layout(mesh, placements, shard_order=order)
        replicas = 1
        for a, p in enumerate(placements):
            if not p.is_shard():
                replicas *= mesh[a]
        seen = {}
        for coord in itertools.product(*(range(n) for n in mesh)):
            held = _brute_force(mesh, placements, order, shape, coord)
            assert lay.local_shape(shape, coord) == tuple(len(h) for h in held), (lay, shape, coord)
            offset = lay.global_offset(shape, coord)
            for h, o in zip(held, offset):
                if h:
                    assert h == list(range(o, o + len(h))), (lay, shape, coord)
            slices = lay.local_slices(shape, coord)
            assert tuple(s.stop - s.start for s in slices) == lay.local_shape(shape, coord)
            for element in itertools.product(*held):
                seen[element] = seen.get(element, 0) + 1
            checked += 1
        # every element is held by exactly the replica count of ranks
        assert len(seen) == (0 if 0 in shape else len(list(itertools.product(*(range(s) for s in shape)))))
        assert all(v == replicas for v in seen.values()), (lay, shape)
    assert checked > 2000


def test_uneven_and_nested_examples():
    lay = Layout((4,), (Shard(0),))
    assert [lay.local_shape((5,), (r,)) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    nested = Layout((2, 2), (Shard(0), Shard(0)))
    assert [nested.local_shape((5, 3), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == \
        [(2, 3), (1, 3), (1, 3), (1, 3)]
    assert [nested.global_offset((8,), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == \
        [(0,), (2,), (4,), (6,)]
    minor_first = Layout((2, 2), (Shard(0), Shard(0)), shard_order={0: (1, 0)})
    assert [minor_first.global_offset((8,), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == \
        [(0,), (4,), (2,), (6,)]
    assert Layout((2,), (Shard(-1),)).local_shape((3, 5), (1,)) == (3, 2)
    assert Layout((4,), (Shard(0),)).shard_sizes((5, 2), (0,), 0) == (2, 2, 1, 0)
    assert Layout((2, 4), (Shard(1), Shard(0))).tensor_map(2) == (0, 1)


def test_alias_layouts():
    names = ("dp", "tp")
    assert Layout.from_alias((2, 2), names, ("tp", "None")).placements == (Replicate(), Shard(0))
    assert Layout.from_alias((2, 2), names, ("None", None)).placements == (Replicate(), Replicate())
    both = Layout.from_alias((2, 2), names, (("dp", "tp"), "None"))
    assert both.placements == (Shard(0), Shard(0)) and both.shard_order == ()
    swapped = Layout.from_alias((2, 2), names, (("tp", "dp"), "None"))
    assert swapped.shard_order == ((0, (1, 0)),)
    assert swapped.local_shape((8, 2), (0, 1)) == (2, 2) and swapped.global_offset((8, 2), (0, 1)) == (4, 0)
    for alias in [("tp", "None"), ("dp", "tp"), (("tp", "dp"), "None"), ("None", ("dp", "tp"))]:
        assert Layout.from_alias((2, 2), names, alias).to_alias(2) == alias
    with pytest.raises(ValueError, match="unknown mesh dim name 'pp'"):
        Layout.from_alias((2, 2), names, ("pp", "None"))
    with pytest.raises(ValueError, match="shards tensor dims 0 and 1"):
        Layout.from_alias((2, 2), names, ("tp", "tp"))
    with pytest.raises(ValueError, match="repeats a mesh dim name"):
        Layout.from_alias((2, 2), names, (("tp", "tp"),))
    with pytest.raises(TypeError, match="one entry per tensor dim"):
        Layout.from_alias((2, 2), names, "tp")
    with pytest.raises(ValueError, match="cannot express Partial"):
        Layout((2,), (Partial(),), mesh_dim_names=("tp",)).to_alias(1)


def test_hyper_parallel_layout_form_called_per_tensor():
    """HyperParallel's ``Layout(mesh_shape, alias_name, rank_list)``, called with one alias entry per
    tensor dim or with placements, gives the same layouts as the placement form."""
    layout = Layout((2, 2, 2), ("dp", "cp", "mp"), list(range(8)))
    assert layout.mesh_dim_names == ("dp", "cp", "mp") and layout.placements == (Replicate(),) * 3
    x = layout("dp", "None", "mp")
    assert x == Layout((2, 2, 2), (Shard(0), Replicate(), Shard(2)), mesh_dim_names=("dp", "cp", "mp"))
    assert x.local_shape((16, 6, 8), (1, 0, 1)) == (8, 6, 4) and x.to_alias(3) == ("dp", "None", "mp")
    nested = layout(("mp", "dp"), "None")
    assert nested == Layout.from_alias((2, 2, 2), ("dp", "cp", "mp"), (("mp", "dp"), "None"))
    assert layout(Shard(1), Replicate(), Replicate()) == layout([Shard(1), Replicate(), Replicate()]) == \
        layout("None", "dp")
    assert layout("mp",).placements == (Replicate(), Replicate(), Shard(0))        # a 1-D tensor
    with pytest.raises(ValueError, match="unknown mesh dim name 'tp'"):
        layout("tp", "None")
    with pytest.raises(TypeError, match="mixes Placement objects and alias names"):
        layout(Shard(0), "None")
    with pytest.raises(ValueError, match="need a layout with mesh dim names"):
        Layout((2,), (Replicate(),))("dp")
    with pytest.raises(ValueError, match="names 1 mesh dims of the 2-D mesh"):
        Layout((2, 2), ("dp",))
    with pytest.raises(ValueError, match="'None' means an unsharded tensor dim"):
        Layout((2, 2), ("dp", "None"))
    with pytest.raises(ValueError, match="mesh dim names twice"):
        Layout((2,), ("dp",), mesh_dim_names=("dp",))
    with pytest.raises(NotImplementedError, match="build the DeviceMesh of those ranks"):
        Layout((2,), ("dp",), [4, 5])
    mesh = types.SimpleNamespace(shape=(2, 2, 2), mesh_dim_names=("dp", "cp", "mp"))     # a DeviceMesh's surface
    assert Layout.from_device_mesh(mesh) == layout and layout.alias_name == ("dp", "cp", "mp")
    with pytest.raises(ValueError, match="needs a mesh with mesh_dim_names"):
        Layout.from_device_mesh(types.SimpleNamespace(shape=(2,), mesh_dim_names=None))


def test_layout_errors_and_value_semantics():
    with pytest.raises(ValueError, match="expected 2 placements"):
        Layout((2, 2), (Shard(0),))
    with pytest.raises(TypeError, match="Shard, Replicate or Partial"):
        Layout((2, 2), (Shard(0), "S0"))
    with pytest.raises(ValueError, match="mesh shape"):
        Layout((0,), (Replicate(),))
    with pytest.raises(ValueError, match="Shard dim 2 is out of range for a 2-D tensor"):
        Layout((2,), (Shard(2),)).local_shape((4, 4), (0,))
    with pytest.raises(ValueError, match="coordinate"):
        Layout((2,), (Shard(0),)).local_shape((4,), (2,))
    with pytest.raises(ValueError, match="not a Shard"):
        Layout((2, 2), (Shard(0), Replicate()), shard_order={0: (1, 0)})
    a = Layout((2, 2), (Shard(0), Partial()), mesh_dim_names=("dp", "tp"))
    b = Layout((2, 2), (Shard(0), Partial()), mesh_dim_names=("dp", "tp"))
    assert a == b and hash(a) == hash(b) and pickle.loads(pickle.dumps(a)) == a
    assert str(a) == "(S(0), P(sum))" and a.partial_dims() == ((1, "sum"),)
    with pytest.raises(AttributeError):
        a.placements = ()
