"""Calibration statistics across processes (``torch.distributed``): each process folds its part
of the calibration batches, then the parts are merged in a fixed order.

:func:`reduce_states` gathers every process's state of each statistic (``all_gather`` of its
tensors, in whatever backend the process group runs: NCCL on GPUs, gloo on CPUs) and merges them
left to right in rank order with the statistic's own ``merge`` (:data:`floatxq.stats.HESSIAN`:
``xtx`` and ``rows`` added; :data:`floatxq.stats.RUNNING_AMAX`: the maximum). Every process ends
with the same bits. Against one process folding every batch in order, the Hessian differs only
by the reassociation of FP32 sums (one addition per entry per extra process); maxima and counts
are exact. :func:`shard_batches` gives a process its contiguous share of the batches.
"""

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from floatxq.stats import Statistic

__all__ = ["merge_in_batch_order", "reduce_states", "shard_batches"]

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


def _gather(tensor: torch.Tensor, world: int, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def reduce_states(
    statistics: Mapping[str, Statistic], states: Mapping[str, Any], group: Any = None
) -> dict[str, Any]:
    """Every process's states merged in rank order (the same result on every process).

    Args:
      statistics: the statistics by name, each with a ``merge``.
      states: this process's state of each (a NamedTuple of tensors, as its ``init`` makes).
      group: the process group (None: the default one, which must be initialised).

    Raises:
      ValueError: a statistic without ``merge``, or states named unlike the statistics.
      RuntimeError: ``torch.distributed`` is not initialised.

    Numerics: as each statistic's ``merge``, applied ``world - 1`` times left to right.
    """
    if set(states) != set(statistics):
        raise ValueError(
            f"reduce_states: states name {sorted(states)}, the statistics {sorted(statistics)}"
        )
    for name, statistic in statistics.items():
        if statistic.merge is None:
            raise ValueError(f"reduce_states: statistic {name!r} has no merge")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("reduce_states: torch.distributed is not initialised")
    world = dist.get_world_size(group)
    merged: dict[str, Any] = {}
    for name in sorted(statistics):  # the same order on every process
        state = states[name]
        fields = [_gather(t, world, group) for t in state]
        per_rank = [type(state)(*(f[r] for f in fields)) for r in range(world)]
        result = per_rank[0]
        for other in per_rank[1:]:
            result = statistics[name].merge(result, other)  # type: ignore[misc]
        merged[name] = result
    return merged


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
