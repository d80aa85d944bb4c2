"""Cut a full model into one pipeline stage's Cell: :func:`split_blocks`.

The common model shape is a Cell list of blocks between optional first-stage layers (an
embedding) and last-stage layers (a final norm, a head); each may sit deeper in the model
(``blocks="encoder.layers"``, ``last=("encoder.norm", "head")``). A stage keeps its contiguous
share of the blocks and puts a :class:`PassThrough` where a first-stage or last-stage layer is
dropped, so an unchanged ``construct`` (a third-party model's: MindSpore's own
``nn.TransformerEncoder`` iterates its ``layers``) runs the stage: the embedding of a later
stage receives the hidden states and passes them on, the head of an earlier stage likewise.
Every kept Parameter keeps the full model's name and Cell path, so optimizers and checkpoints
see the usual names.

Example::

    model = split_blocks(Model(), 1, 2, blocks="encoder.layers", first=("embed",), last=("head",))
    model.embed                  # PassThrough(replaces='embed')
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence, Tuple

from mindspore import nn

from ..nn._adapter import STANDS_IN

__all__ = ["PassThrough", "StageCellList", "split_blocks"]


class PassThrough(nn.Cell):
    """What a stage holds in place of a layer of another stage: returns its first positional
    argument (the hidden states) and ignores the others (masks, positions, keyword arguments).

    A ``parallelize_module`` plan key naming the layer it replaces is skipped on this stage, as
    the layer runs elsewhere (no warning). It fits layers on the model's chain of hidden states (an embedding, a final norm, a head): a
    ``construct`` calling ``self.embed(x)`` on a later stage then passes the received hidden states
    on. A dropped layer whose output is combined with other values (a positional embedding added
    to the token embedding) would give that sum the wrong term: keep such layers inside the first
    stage's embedding Cell, or make ``construct`` skip them on the stages that drop them.

    Args:
        replaces: the dotted path of the layer it stands for (shown in ``repr``).

    Example::

        PassThrough("embed")(hidden, mask=m) is hidden          # True
    """

    def __init__(self, replaces: str = "") -> None:
        super().__init__()
        self.replaces = replaces
        setattr(self, STANDS_IN, True)       # a parallelize plan naming the layer skips it here

    def construct(self, *args, **kwargs):
        return args[0]

    def extend_repr(self) -> str:
        return f"replaces={self.replaces!r}"


class StageCellList(nn.CellList):
    """A stage's share of an ``nn.CellList`` of blocks, each under its full-model key.

    Iteration and ``len`` are a CellList's; ``blocks[i]`` is the i-th kept block; the child
    names (``"5"`` for the full model's block 5) make Cell paths, state-dict keys and
    checkpoints name the full model's blocks.

    Args:
        blocks: full-model key -> block, in order.

    Example::

        kept = StageCellList(OrderedDict([("2", block2), ("3", block3)]))
        [name for name, _ in kept.cells_and_names()][1:]      # ['2', '3']
    """

    def __init__(self, blocks: "OrderedDict[str, nn.Cell]") -> None:
        super().__init__()
        for key, block in blocks.items():
            self.insert_child_to_cell(key, block)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return StageCellList(OrderedDict(list(self._cells.items())[index]))
        return list(self)[index]


def _block_range(n_blocks: int, stage_index: int, num_stages: int) -> Tuple[int, int]:
    """[start, stop) of the blocks of a stage: contiguous, as even as can be, earlier stages larger.

    >>> [_block_range(5, s, 2) for s in range(2)]
    [(0, 3), (3, 5)]
    """
    base, extra = divmod(n_blocks, num_stages)
    start = stage_index * base + min(stage_index, extra)
    return start, start + base + (stage_index < extra)


def _resolve(model: nn.Cell, path: str, argument: str) -> Tuple[nn.Cell, str]:
    """The Cell holding the attribute ``path`` names (dotted: ``"encoder.layers"``) and that
    attribute's name; raises naming the argument and the first missing step."""
    if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
        raise TypeError(f"split_blocks {argument} must be an attribute path such as 'layers' or 'encoder.layers', "
                        f"got {path!r}")
    *parents, attr = path.split(".")
    holder, walked = model, type(model).__name__
    for part in parents:
        child = getattr(holder, part, None)
        if not isinstance(child, nn.Cell):
            raise AttributeError(f"split_blocks {argument}={path!r}: {walked} has no Cell {part!r} (it holds "
                                 f"{type(child).__name__}); its child Cells are {sorted(holder.name_cells())}")
        holder, walked = child, f"{walked}.{part}"
    if not hasattr(holder, attr):
        raise AttributeError(f"split_blocks {argument}={path!r}: {walked} has no attribute {attr!r}; its child Cells "
                             f"are {sorted(holder.name_cells())}")
    return holder, attr


def _paths(value: Sequence[str], argument: str) -> List[str]:
    if isinstance(value, str):
        raise TypeError(f"split_blocks {argument} must be a tuple of attribute paths, got the string {value!r}; "
                        f"write {argument}=({value!r},)")
    return list(value)


def split_blocks(model: nn.Cell, stage_index: int, num_stages: int, *, blocks: str = "layers",
                 first: Sequence[str] = (), last: Sequence[str] = ()) -> nn.Cell:
    """Keep in ``model`` only what stage ``stage_index`` of ``num_stages`` runs; returns ``model``.

    ``model.<blocks>`` (an ``nn.CellList`` or ``nn.SequentialCell``, at a dotted path such as
    ``"encoder.layers"``) keeps its contiguous share of the blocks (as even as can be, earlier
    stages one more); the layers named in ``first`` are kept on stage 0 only and those in ``last``
    on the last stage only; elsewhere each becomes a :class:`PassThrough` returning its first
    argument, so an unchanged ``construct`` runs the stage (a layer that is ``None`` stays ``None``).
    Kept Parameters keep their full-model names and the kept blocks their full-model keys
    (``layers.5.weight`` stays so on the stage holding block 5, as a Parameter name and as a
    state-dict key), so checkpoints saved by the stages load into any other split and into the
    whole model. A refused call leaves ``model`` as it was.

    Args:
        model: the full model, built the same way (same seed) on every rank.
        stage_index: this stage's index.
        num_stages: the number of stages.
        blocks: the attribute path of the list of blocks (``"layers"``, ``"encoder.layers"``).
        first: attribute paths only the first stage keeps (e.g. ``("embed",)``).
        last: attribute paths only the last stage keeps (e.g. ``("encoder.norm", "head")``).

    Example::

        class Model(nn.Cell):                       # nothing here knows about stages
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(256, 64)
                self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, batch_first=True), 4)
                self.head = nn.Dense(64, 256)

            def construct(self, ids):
                return self.head(self.encoder(self.embed(ids)))

        stage_cell = split_blocks(Model(), 1, 2, blocks="encoder.layers", first=("embed",), last=("head",))
    """
    for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"split_blocks {name} must be an int, got {value!r}")
    if num_stages < 1 or not 0 <= stage_index < num_stages:
        raise ValueError(f"split_blocks: stage_index must be in 0..{num_stages - 1} (num_stages={num_stages}), "
                         f"got {stage_index}")
    holder, attr = _resolve(model, blocks, "blocks")
    listed = getattr(holder, attr)
    if not isinstance(listed, (nn.CellList, nn.SequentialCell)):
        raise TypeError(f"split_blocks: {type(model).__name__}.{blocks} must be an nn.CellList or nn.SequentialCell, "
                        f"got {type(listed).__name__}; pass blocks=<the attribute path of the blocks>")
    if len(listed) < num_stages:
        raise ValueError(f"split_blocks: {len(listed)} blocks cannot make {num_stages} stages (one block at least "
                         f"per stage); use at most {len(listed)} stages")
    dropped = [(path, *_resolve(model, path, argument))
               for argument, paths, keep in (("first", first, stage_index == 0),
                                             ("last", last, stage_index == num_stages - 1))
               for path in _paths(paths, argument) if not keep]
    for path, cell, name in dropped:
        value = getattr(cell, name)
        if value is not None and not isinstance(value, nn.Cell):
            raise TypeError(f"split_blocks: {path!r} holds a {type(value).__name__}, not a Cell: first / last name "
                            f"the layers (Cells) another stage runs")
    names = {id(p): p.name for p in model.get_parameters()}
    start, stop = _block_range(len(listed), stage_index, num_stages)
    kept = OrderedDict((str(i), listed[i]) for i in range(start, stop))
    # the kept blocks keep their full-model keys ("layers.5"), so the stage's Cell paths (which
    # checkpoints' state dicts use) are the full model's too
    setattr(holder, attr, StageCellList(kept) if isinstance(listed, nn.CellList) else nn.SequentialCell(kept))
    for path, cell, name in dropped:
        if getattr(cell, name) is not None:       # a layer the model left out stays out
            setattr(cell, name, PassThrough(path))
    for p in model.get_parameters():      # MindSpore renames Parameters of re-set lists: put the full names back
        p.name = names[id(p)]
    return model
