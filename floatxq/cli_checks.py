"""What the command line does with user errors: the checks its commands run on their arguments
before any work, and the library's errors turned into one ``error: <message>`` line on stderr
and exit code 2 (:func:`reported`).

Importing it is cheap (typer and click only): torch and floatxq load inside the checks that need
them.
"""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import typer

__all__ = [
    "DECIDED_EXITS",
    "DEVICE_ERRORS",
    "INPUT_ERRORS",
    "activation_policy",
    "check_at_least",
    "check_device",
    "check_png",
    "fail",
    "fail_from",
    "reported",
    "shown",
]

# What the library raises on bad user input (CheckpointError is a ValueError; OSError covers
# PermissionError, FileNotFoundError and FileExistsError). RuntimeError joins them only around
# model work on a device (torch's device errors, an already-quantized model).
INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OSError)
DEVICE_ERRORS: tuple[type[Exception], ...] = (*INPUT_ERRORS, RuntimeError)
# An exit already decided (``fail`` printed its line): typer's and click's Exit and Abort are
# RuntimeErrors, so ``DEVICE_ERRORS`` would catch them and print a second ``error: Exit`` line.
DECIDED_EXITS: tuple[type[Exception], ...] = (
    typer.Exit,
    typer.Abort,
    click.exceptions.Exit,
    click.exceptions.Abort,
)


def fail(message: str) -> "typer.Exit":
    """Print ``error: <message>`` on one line of stderr; the caller raises the returned Exit."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(code=2)


def fail_from(exc: Exception) -> "typer.Exit":
    """``fail`` with a library exception's own message (its type name when it has none)."""
    return fail(str(exc).strip() or type(exc).__name__)


@contextlib.contextmanager
def reported(kinds: tuple[type[Exception], ...] = INPUT_ERRORS) -> Iterator[None]:
    """Around library calls: an exception of ``kinds`` becomes one ``error:`` line and exit 2;
    an exit already decided inside (a ``fail``) passes through as it is."""
    try:
        yield
    except DECIDED_EXITS:
        raise
    except kinds as exc:
        raise fail_from(exc) from None


def shown(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for a message (user input can be megabytes)."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_device(device: str | None) -> None:
    """Refuse a ``--device`` that torch cannot parse or that this machine does not have."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise fail(
            f"--device {device!r} is not a torch device; accepted: cpu, cuda, cuda:N, mps"
        ) from None
    if dev.type == "cpu":
        return
    if dev.type == "meta":
        raise fail("--device meta holds no data to quantize or evaluate; use cpu or cuda")
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available) or not is_available():
        raise fail(f"--device {device!r}: torch sees no {dev.type} device on this machine")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise fail(f"--device {device!r}: this machine has {count()} {dev.type} device(s)")


def check_at_least(option: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise fail(f"{option} must be at least {minimum}, got {value}")


def check_png(png: Path) -> None:
    """Refuse a chart path that cannot be written, before the work that precedes the chart."""
    if png.is_dir():
        raise fail(f"--png {png} is a directory; give a file name")
    if not png.parent.is_dir():
        raise fail(f"--png {png}: the directory {png.parent} does not exist")


def activation_policy(spec: str) -> Any:
    """``--activation``: a mode name or the policy's JSON (read by ``bounded_json_loads``: no
    deep nesting, huge integers or non-finite numbers)."""
    import floatxq
    from floatxq._checks import bounded_json_loads

    text = spec.strip()
    if text[:1] in ("{", "["):
        try:
            value = bounded_json_loads(text, where="--activation")
        except ValueError as exc:
            detail = str(exc).removeprefix("--activation: ")
            raise fail(
                f"--activation {shown(spec)} is not JSON floatxq accepts: {detail}"
            ) from None
    else:
        value = text.lower()
    try:
        return floatxq.ActivationConfig.from_value(value)
    except (TypeError, ValueError) as exc:
        raise fail(f"--activation {shown(spec)}: {exc}") from None
