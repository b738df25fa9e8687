"""Calibration statistics across processes (``torch.distributed``): each process folds its
contiguous share of the calibration batches (:func:`shard_batches`), and the folds are joined in
batch order.

:func:`merge_in_batch_order` passes the running fold from rank to rank; each later rank adds its
own batches' folds to it in order with the statistic's ``merge`` (:data:`floatxq.stats.HESSIAN`:
``xtx`` and ``rows`` added; :data:`floatxq.stats.RUNNING_AMAX`: the maximum), so the result is
the one-process fold bit for bit, and the last rank's goes to every process. A merge of whole
per-process folds instead would reassociate the FP32 sums, and GPTQ's codes follow the last
bits of its Hessian. :class:`BatchFold` is what the layer-by-layer drivers fold with.
"""

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from floatxq.stats import Statistic, fold_all

__all__ = ["BatchFold", "merge_in_batch_order", "shard_batches"]

T = TypeVar("T")


def shard_batches(batches: Sequence[T], rank: int, world: int) -> list[T]:
    """Process ``rank``'s contiguous share of ``batches`` (the first ``len % world`` processes
    take one more); concatenated in rank order they are ``batches``.

    Raises:
      ValueError: ``world`` < 1 or ``rank`` outside ``[0, world)``.

    Example:
      >>> [shard_batches(list(range(5)), r, 2) for r in range(2)]
      [[0, 1, 2], [3, 4]]
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_batches: rank {rank} of world {world} is not a process")
    base, extra = divmod(len(batches), world)
    start = rank * base + min(rank, extra)
    return list(batches[start : start + base + (rank < extra)])


def _send_state(state: Any, dst: int, group: Any) -> None:
    for tensor in state:
        dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv_state(like: Any, src: int, group: Any) -> Any:
    fields = []
    for tensor in like:
        buf = torch.empty_like(tensor)
        dist.recv(buf, src=src, group=group)
        fields.append(buf)
    return type(like)(*fields)


def merge_in_batch_order(
    statistics: Mapping[str, Statistic],
    folded: Mapping[str, Any] | None,
    per_batch: Sequence[Mapping[str, Any]],
    group: Any = None,
) -> dict[str, Any]:
    """The one-process fold of every batch, in batch order, bit for bit, from processes holding
    contiguous shares: each process's batches are added to the running fold of the ones before
    it, which passes from rank to rank; the last rank's result goes to all.

    Args:
      statistics: the statistics by name, each with a ``merge``.
      folded: rank 0's fold of its batches (it needs nothing before them); None elsewhere.
      per_batch: on other ranks, each of its batches folded into an empty state, in order
        (``merge(prefix, fold(empty, batch))`` is then the one-process ``fold(prefix, batch)``:
        the empty state adds exact zeros).
      group: the process group (None: the default one).

    Raises:
      ValueError: a statistic without ``merge``; rank 0 without ``folded``, another with it.

    Numerics: exactly the one-process fold's (the same FP32 additions in the same order).
    """
    for name, statistic in statistics.items():
        if statistic.merge is None:
            raise ValueError(f"merge_in_batch_order: statistic {name!r} has no merge")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (rank == 0) != (folded is not None):
        raise ValueError("merge_in_batch_order: rank 0 gives its fold, the others per batch")
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    merged: dict[str, Any] = {}
    for name in sorted(statistics):
        statistic = statistics[name]
        if rank == 0:
            state = folded[name]  # type: ignore[index]
        else:
            state = _recv_state(per_batch[0][name], to_global(rank - 1), group)
            for batch in per_batch:
                state = statistic.merge(state, batch[name])  # type: ignore[misc]
        if rank < world - 1:
            _send_state(state, to_global(rank + 1), group)
        fields = []
        for tensor in state:
            buf = tensor.contiguous().clone()
            dist.broadcast(buf, src=to_global(world - 1), group=group)
            fields.append(buf)
        merged[name] = type(state)(*fields)
    return merged


class BatchFold:
    """Batches folded into ``statistics`` (from the empty ``states``) as one process folds them
    in order; with a process ``group``, every process's share joined in batch order
    (:func:`merge_in_batch_order`): rank 0 folds as one process does, the others keep each
    batch's fold until the running fold reaches them."""

    def __init__(
        self, statistics: Mapping[str, Statistic], states: Mapping[str, Any], group: Any = None
    ) -> None:
        self.statistics, self.empty, self.group = statistics, dict(states), group
        self.first = group is None or dist.get_rank(group) == 0
        self.folded = dict(states)
        self.per_batch: list[dict[str, Any]] = []

    def add(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold one batch's rows (``mask``: its keep-mask, as :func:`floatxq.stats.fold_all`)."""
        if self.first:
            self.folded = fold_all(self.statistics, self.folded, x, mask=mask)
        else:
            self.per_batch.append(fold_all(self.statistics, self.empty, x, mask=mask))

    def states(self) -> dict[str, Any]:
        """The fold of every batch (every process's, with a group)."""
        if self.group is None or not self.statistics:
            return self.folded
        return merge_in_batch_order(
            self.statistics, self.folded if self.first else None, self.per_batch, self.group
        )
