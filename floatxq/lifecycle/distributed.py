"""A calibrated run shared by the processes of a ``torch.distributed`` group (one per GPU, as
``torchrun`` starts them): the calibration batches dealt out, the statistics folded in the one
process's batch order, the module solves spread over the processes and their results broadcast.

- :func:`share_calibration` deals batch ``b`` to process ``b % world`` (:func:`shard_batches`)
  and returns the :class:`ProcessShare` the drivers pass on.
- :class:`BatchFold` folds them: each process folds its batch into an empty state, takes the
  running fold of every batch before it from the previous process, adds its own
  (``Statistic.merge``: for :data:`floatxq.stats.HESSIAN` one FP32 addition, which is exactly the
  one-process ``xtx + xᵀx``) and passes it on; the owner of the last batch broadcasts the whole.
  So the fold is the one-process fold bit for bit, while every process holds at most one state
  more than one process does and the products (the expensive part) run in parallel. A merge of
  whole per-process folds instead would reassociate the FP32 sums, and GPTQ's codes follow the
  last bits of its Hessian.
- :func:`spread` solves each of a group of modules on one process (:func:`owners`: the largest
  first, each to the least loaded) and broadcasts every built module and its report to all
  (:func:`broadcast_module`), so every process continues with the same model. With
  ``split_rows`` GPTQ instead solves a share of every module's rows on each process
  (:func:`row_share`) and joins them (:func:`gather_rows`).
- :func:`torchrun_setup` joins the run ``torchrun`` started; :func:`check_process_group` and
  :func:`check_split_rows` check ``quantize``'s arguments.

Over gloo, CUDA tensors travel through host memory (gloo sends only CPU tensors).
"""

import copy
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.stats import Statistic, fold_all

__all__ = [
    "BatchFold",
    "ProcessShare",
    "broadcast_module",
    "check_process_group",
    "check_split_rows",
    "gather_rows",
    "owners",
    "row_share",
    "shard_batches",
    "share_calibration",
    "spread",
    "torchrun_setup",
]

T = TypeVar("T")


class ProcessShare(NamedTuple):
    """This process's part in a run whose calibration a process group shares."""

    group: Any
    """The ``torch.distributed`` process group (None: the default one)."""
    rank: int
    """This process's rank in ``group``."""
    world: int
    """The group's size."""
    batches: int
    """The whole calibration's batch count (batch ``b`` is process ``b % world``'s)."""
    split_rows: bool = False
    """GPTQ: every module's rows split over the processes (:func:`row_share`) instead of whole
    modules dealt out; the same bits only where the GEMMs do not depend on the row count."""

    @classmethod
    def of(cls, group: Any, batches: int = 0, split_rows: bool = False) -> "ProcessShare":
        """``group``'s share for this process (``batches``: the calibration's, 0 without)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return cls(group, rank, world, batches, split_rows)

    @property
    def gloo(self) -> bool:
        """Over gloo, which sends CPU tensors only (CUDA ones go through host memory)."""
        return dist.get_backend(self.group) == "gloo"

    def global_rank(self, rank: int) -> int:
        """``rank`` of the group as the default group numbers it (what send/recv take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def shard_batches(batches: Sequence[T], rank: int, world: int) -> list[T]:
    """Process ``rank``'s batches: every ``world``-th from the ``rank``-th, so batch ``b`` is
    process ``b % world``'s and the shares differ by at most one.

    Raises:
      ValueError: ``world`` < 1 or ``rank`` outside ``[0, world)``.

    Example:
      >>> [shard_batches(list(range(5)), r, 2) for r in range(2)]
      [[0, 2, 4], [1, 3]]
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_batches: rank {rank} of world {world} is not a process")
    return list(batches[rank::world])


def share_calibration(
    calibration: CalibrationSet, group: Any, *, where: str, split_rows: bool = False
) -> tuple[CalibrationSet, ProcessShare]:
    """This process's batches of ``calibration`` (the sample and token counts stay the whole's)
    and its :class:`ProcessShare` of ``group``.

    Raises:
      ValueError: fewer batches than processes.
    """
    share = ProcessShare.of(group, len(calibration.batches), split_rows)
    total, world = share.batches, share.world
    if total < world:
        raise ValueError(
            f"{where}: {total} calibration batches cannot be shared by {world} processes; give "
            f"at least one batch per process (more samples or a smaller batch_size)"
        )
    mine = calibration._replace(
        batches=tuple(shard_batches(calibration.batches, share.rank, world))
    )
    return mine, share


def _send(state: Any, dst: int, share: ProcessShare) -> None:
    for tensor in state:
        out = tensor.cpu() if tensor.is_cuda and share.gloo else tensor.contiguous()
        dist.send(out, dst=share.global_rank(dst), group=share.group)


def _recv(like: Any, src: int, share: ProcessShare) -> Any:
    fields = []
    for tensor in like:
        staged = tensor.is_cuda and share.gloo
        buf = torch.empty(tensor.shape, dtype=tensor.dtype) if staged else torch.empty_like(tensor)
        dist.recv(buf, src=share.global_rank(src), group=share.group)
        fields.append(buf.to(tensor.device) if staged else buf)
    return type(like)(*fields)


def _broadcast_into(tensor: torch.Tensor, src: int, share: ProcessShare) -> torch.Tensor:
    """``tensor`` (contiguous) filled in place with ``src``'s bytes (any dtype: FP8 too)."""
    if tensor.numel() == 0:
        return tensor
    data = tensor.reshape(-1).view(torch.uint8)
    if tensor.is_cuda and share.gloo:
        staged = data.cpu()
        dist.broadcast(staged, src=share.global_rank(src), group=share.group)
        data.copy_(staged)
    else:
        dist.broadcast(data, src=share.global_rank(src), group=share.group)
    return tensor


class BatchFold:
    """Batches folded into ``statistics`` (from the empty ``states``) as one process folds them
    in order. With a :class:`ProcessShare`, each process adds its batches (in order) and the
    running fold passes from process to process in batch order (the module docstring), so
    :meth:`states` is the one-process fold bit for bit on every process.

    Raises:
      ValueError: a statistic without ``merge`` under a share of more than one process.
    """

    def __init__(
        self,
        statistics: Mapping[str, Statistic],
        states: Mapping[str, Any],
        share: ProcessShare | None = None,
    ) -> None:
        self.statistics, self.empty, self.share = dict(statistics), dict(states), share
        self.shared = share is not None and share.world > 1 and bool(statistics)
        if self.shared:
            for name, statistic in statistics.items():
                if statistic.merge is None:
                    raise ValueError(f"BatchFold: statistic {name!r} has no merge")
        self.folded = dict(states)
        self.batch = share.rank if share is not None else 0  # the next add's batch index

    def add(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold one batch's rows (``mask``: its keep-mask, as :func:`floatxq.stats.fold_all`);
        with a share, this process's next batch."""
        if not self.shared:
            self.folded = fold_all(self.statistics, self.folded, x, mask=mask)
            return
        share = self.share
        assert share is not None
        batch, self.batch = self.batch, self.batch + share.world
        own = fold_all(self.statistics, self.empty, x, mask=mask)
        if batch > 0:  # the running fold of batches 0 .. batch-1, from the process before
            before = share.rank - 1 if share.rank else share.world - 1
            merged = {}
            for name in sorted(self.statistics):
                prefix = _recv(own[name], before, share)
                merged[name] = self.statistics[name].merge(prefix, own[name])  # type: ignore[misc]
            own = merged
        if batch < share.batches - 1:
            for name in sorted(self.statistics):
                _send(own[name], (share.rank + 1) % share.world, share)
        self.folded = own

    def states(self) -> dict[str, Any]:
        """The fold of every batch (every process's, with a share: the last batch's owner
        broadcasts it)."""
        if not self.shared:
            return self.folded
        share = self.share
        assert share is not None
        last = (share.batches - 1) % share.world
        source = self.folded if share.rank == last else self.empty
        merged: dict[str, Any] = {}
        for name in sorted(self.statistics):
            fields = [_broadcast_into(t.contiguous().clone(), last, share) for t in source[name]]
            merged[name] = type(source[name])(*fields)
        return merged


def owners(costs: Sequence[float], world: int) -> list[int]:
    """Which process solves each item: the costliest first, each to the least loaded process
    (the lowest rank among equals), so every process computes the same answer.

    Raises:
      ValueError: ``world`` < 1.

    Example:
      >>> owners([4.0, 1.0, 1.0], 2)
      [0, 1, 1]
    """
    if world < 1:
        raise ValueError(f"owners: world must be at least 1, got {world}")
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += costs[i]
    return owner


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _skeleton(module: nn.Module) -> nn.Module:
    """``module``'s structure on the meta device (no values copied)."""
    memo: dict[int, Any] = {}
    for _, tensor in _named_tensors(module):
        meta = tensor.detach().to("meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    skeleton = copy.deepcopy(module, memo)
    for sub in skeleton.modules():
        for key, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                raise TypeError(
                    f"broadcast_module: {type(sub).__name__}.{key} is a tensor that is neither a "
                    f"parameter nor a buffer; it cannot be sent"
                )
    return skeleton


def _to_cpu(value: Any) -> Any:
    """Tensors inside a report moved to the CPU (a pickled CUDA tensor names its sender's GPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class _Failure(NamedTuple):
    """A build that raised on its owner, sent in place of the module so every process raises."""

    kind: type[Exception]
    message: str

    @classmethod
    def of(cls, error: Exception) -> "_Failure":
        kind = type(error)
        try:  # a class pickles by its import path: a local one cannot travel
            pickle.dumps(kind)
        except Exception:
            return cls(RuntimeError, f"{kind.__name__}: {error}")
        return cls(kind, str(error))

    def error(self, src: int) -> Exception:
        """The exception to raise here: the owner's type and message (RuntimeError naming the
        type where the type does not take one message)."""
        try:
            error = self.kind(self.message)
        except Exception:
            error = RuntimeError(f"{self.kind.__name__}: {self.message}")
        error.add_note(f"(raised by process {src}, which built this module)")
        return error


def broadcast_module(
    built: tuple[nn.Module, Any] | Exception | None,
    src: int,
    share: ProcessShare,
    device: torch.device,
) -> tuple[nn.Module, Any]:
    """Process ``src``'s ``(module, report)`` on every process: its structure and report
    pickled (tensors in the report on the CPU), its parameters and buffers broadcast as bytes
    into new tensors on ``device``; ``src`` returns its own. An exception given by ``src``
    (its build failed) is raised on every process instead: ``src`` raises its own, the others
    one of the same type and message.

    Raises:
      ValueError: ``built`` is None on ``src`` or given elsewhere.
      TypeError: the module holds a tensor that is neither a parameter nor a buffer.
    """
    if (share.rank == src) != (built is not None):
        raise ValueError("broadcast_module: the source process gives its module, no other")
    on = device if device.type == "cuda" and not share.gloo else None
    payload: list[Any] = [None]
    if isinstance(built, Exception):
        payload = [pickle.dumps(_Failure.of(built))]
    elif built is not None:
        module, report = built
        payload = [pickle.dumps((_skeleton(module), _to_cpu(report)))]
    dist.broadcast_object_list(payload, src=share.global_rank(src), group=share.group, device=on)
    if isinstance(built, Exception):
        raise built
    if built is not None:
        for _, tensor in _named_tensors(built[0]):
            _broadcast_into(tensor.detach().contiguous(), src, share)
        return built
    received = pickle.loads(payload[0])
    if isinstance(received, _Failure):
        raise received.error(src)
    skeleton, report = received
    module = skeleton.to_empty(device=device)
    for _, tensor in _named_tensors(module):
        _broadcast_into(tensor.detach(), src, share)
    return module, report


def spread(
    costs: Sequence[float],
    solve: Callable[[int], tuple[nn.Module, Any]],
    share: ProcessShare | None,
    device: torch.device,
) -> Iterator[tuple[nn.Module, Any]]:
    """Item ``i``'s ``solve(i) -> (module, report)``, in order: without a share each solved
    here as it is asked for; with one, each solved by its owner (:func:`owners`), this
    process's first, then every result broadcast from its owner (:func:`broadcast_module`).

    Raises:
      Exception: the first of this process's solves that raised stops its solves and is sent in
        place of that item's module; every process raises it when the item's turn comes (the
        owner its own, the others one of its type and message), after yielding the items
        before it, so all stop at the same item.
    """
    if share is None or share.world == 1:
        yield from (solve(i) for i in range(len(costs)))
        return
    owner = owners(costs, share.world)
    mine: dict[int, tuple[nn.Module, Any] | Exception] = {}
    for i in range(len(costs)):
        if owner[i] == share.rank:
            try:
                mine[i] = solve(i)
            except Exception as error:  # sent in place of the module: the others stop too
                mine[i] = error
                break
    for i in range(len(costs)):
        yield broadcast_module(mine.pop(i, None), owner[i], share, device)


def check_process_group(group: Any, *, where: str) -> Any:
    """``group`` if it is a ``torch.distributed`` process group of an initialised run (None
    passes through).

    Raises:
      RuntimeError: ``torch.distributed`` is not initialised.
      TypeError: ``group`` is not a process group.
    """
    if group is None:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{where}: process_group needs torch.distributed initialised first (under torchrun: "
            f"floatxq.torchrun_setup(), or torch.distributed.init_process_group)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{where}: process_group must be a torch.distributed ProcessGroup (e.g. "
            f"torch.distributed.group.WORLD), got {type(group).__name__}"
        )
    return group


def torchrun_setup(backend: str | None = None) -> tuple[Any, torch.device]:
    """Join the run ``torchrun`` started (its ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and
    rendezvous variables): the default process group initialised if it is not yet (``nccl``
    with CUDA, else ``gloo``, unless ``backend``), this process's GPU made the current device.
    Returns the group to pass as ``quantize(..., process_group=...)`` and the work device
    (``cuda:LOCAL_RANK``, or the CPU without CUDA).

    Raises:
      RuntimeError: not started by ``torchrun`` (no ``WORLD_SIZE`` / ``LOCAL_RANK``), or more
        local processes than GPUs.

    Numerics: none (it joins the process group and picks the device).
    """
    import os

    if "WORLD_SIZE" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise RuntimeError(
            "torchrun_setup: WORLD_SIZE and LOCAL_RANK are not set; start the script with "
            "torchrun --nproc-per-node N script.py"
        )
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"torchrun_setup: local rank {local} has no GPU ({torch.cuda.device_count()} "
                f"visible); start at most that many processes per node"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(chosen, device_id=device if chosen == "nccl" else None)
    return dist.group.WORLD, device


def gather_rows(parts: Sequence[torch.Tensor], share: ProcessShare) -> list[torch.Tensor]:
    """Each of ``parts`` (this process's rows, the same shape on every process) joined along
    its first axis in rank order, on every process: every process's rows broadcast as bytes.

    Numerics: exact (bytes moved).
    """
    joined = []
    for part in parts:
        rows = part.shape[0]
        whole = torch.empty((share.world * rows, *part.shape[1:]), dtype=part.dtype,
                            device=part.device)  # fmt: skip
        for rank in range(share.world):
            piece = whole[rank * rows : (rank + 1) * rows]
            if rank == share.rank:
                piece.copy_(part)
            _broadcast_into(piece, rank, share)
        joined.append(whole)
    return joined


def row_share(rows: int, share: ProcessShare | None) -> slice | None:
    """This process's rows of a module solved by rows (:attr:`ProcessShare.split_rows`): an
    equal contiguous share; None when the module is solved whole (no split asked, one process,
    or ``rows`` not a multiple of the process count)."""
    if share is None or not share.split_rows or share.world == 1 or rows % share.world:
        return None
    part = rows // share.world
    return slice(share.rank * part, (share.rank + 1) * part)


def check_split_rows(split_rows: object, group: Any, gptq: bool, *, where: str) -> bool:
    """``split_rows`` if it can be honoured: a bool, True only with a process group and GPTQ.

    Raises:
      TypeError: not a bool. ValueError: True without a group or for another method.
    """
    if not isinstance(split_rows, bool):
        raise TypeError(f"{where}: split_rows must be a bool, got {type(split_rows).__name__}")
    if split_rows and (group is None or not gptq):
        raise ValueError(
            f"{where}: split_rows=True splits GPTQ's module solves over a process_group; give "
            f"both a GPTQConfig and a process_group, or leave it False"
        )
    return split_rows
