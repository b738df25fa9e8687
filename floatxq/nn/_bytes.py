"""Quantized buffers move as bytes: the one ``_apply`` / ``_load_from_state_dict`` of every
quantized module (:class:`ByteBuffers`). ``.half()`` or ``.to(torch.bfloat16)`` moves codes,
scales and staged operands but never casts them; an incoming state dict is checked by the
module's hook before ``nn.Module``'s load.
"""

from collections.abc import Callable
from typing import Any

import torch

from floatxq._typing import Tensor

__all__ = ["ByteBuffers", "move_bytes"]


def move_bytes(fn: Callable[[Tensor], Tensor], tensor: Tensor) -> Tensor:
    """Apply ``fn``'s device move to ``tensor`` but never its dtype cast."""
    try:
        probe = fn(tensor.new_empty(0))
    except Exception:  # a cast this dtype does not support: learn the device from FP32
        probe = fn(torch.empty(0, device=tensor.device))
        return tensor.to(device=probe.device)
    return fn(tensor) if probe.dtype == tensor.dtype else tensor.to(device=probe.device)


class ByteBuffers:
    """Mixin (before ``nn.Module``): the named buffers move as bytes; loads are checked first.

    Hooks a module overrides: :meth:`_byte_buffer_names`, :meth:`_moved` (a buffer after the
    move, e.g. a bias cast), :meth:`_applied` (after every move: drop runtime caches),
    :meth:`_incoming` (check a state dict before the load) and :meth:`_loaded` (after it).
    """

    _buffers: dict[str, Tensor | None]

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # type: ignore[misc]
        if name in self._buffers and "_plans" in self.__dict__:  # (plans and bound launches
            self.__dict__["_plans"] = {}  # hold the buffers they read: a new one drops them)

    def __getstate__(self) -> dict[str, Any]:  # (copies and pickles drop them too)
        return {**super().__getstate__(), "_plans": {}}  # type: ignore[misc]

    def _byte_buffer_names(self) -> tuple[str, ...]:
        return ()

    def _moved(self, name: str, fn: Callable[[Tensor], Tensor], tensor: Tensor) -> Tensor:
        """``tensor`` (buffer ``name``) moved by ``fn`` as bytes."""
        if tensor.element_size() == 1 and tensor.dtype != torch.uint8:
            return move_bytes(fn, tensor.view(torch.uint8)).view(tensor.dtype)
        return move_bytes(fn, tensor)

    def _applied(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Called once the module and its byte buffers moved."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        held = {
            n: self._buffers[n]
            for n in self._byte_buffer_names()
            if self._buffers.get(n) is not None
        }
        for name in held:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)  # type: ignore[misc]
            self._before_moves(fn)
        except BaseException:
            self._buffers.update(held)
            raise
        for name, tensor in held.items():
            self._buffers[name] = self._moved(name, fn, tensor)
        self._applied(fn)
        return self

    def _before_moves(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Called after ``nn.Module._apply`` and before the byte buffers move (may raise: the
        buffers are then restored)."""

    def _incoming(
        self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> tuple[dict[str, Any], list[str]]:
        """``(entries to replace, keys rejected)`` of an incoming state dict; a rejected key's
        message is appended to ``error_msgs`` (or ``ValueError`` raised before anything changes)."""
        return {}, []

    def _loaded(self, prefix: str, missing_keys: list[str]) -> None:
        """Called after ``nn.Module``'s load (restore formats, empty caches)."""

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        replaced, rejected = self._incoming(state_dict, prefix, error_msgs)
        if replaced or rejected:
            state_dict = {k: v for k, v in state_dict.items() if k not in rejected}
            state_dict.update(replaced)
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for key in rejected:  # reported by _incoming, not as "missing"
            if key in missing_keys:
                missing_keys.remove(key)
        self._loaded(prefix, missing_keys)
