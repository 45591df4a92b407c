"""What probes use: they run in the sandbox beside student code (and in the ranks it starts)
and only *collect*: look a function up, call it, describe what came back as plain data.
Judging happens in the grader (:mod:`autograder.checking.expect`). No pytest here.
"""
from __future__ import annotations

import inspect

import torch


def student_function(ns: dict, name, params=None):
    """The student's function ``name``, or a clear error if it is missing or takes other
    arguments. ``params``: the parameter names, or the spec's :class:`Function`."""
    if hasattr(name, "params"):
        name, params = name.name, name.params
    fn = ns.get(name)
    if fn is None:
        raise LookupError(f"{name} is not defined: did its cell run without errors?")
    if not callable(fn):
        raise TypeError(f"{name} should be a function, not {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
        sig.bind(*params)
    except TypeError:
        raise TypeError(f"{name} should take ({', '.join(params)}); yours takes {sig}") from None
    except ValueError:
        pass
    return fn


def describe(value):
    """A returned value as plain data: tensors as detached CPU copies with their metadata."""
    if type(value) is torch.Tensor:
        return {"kind": "tensor", "value": value.detach().to("cpu", copy=True),
                "device": str(value.device), "requires_grad": bool(value.requires_grad)}
    if isinstance(value, (list, tuple)):
        return {"kind": type(value).__name__, "items": [describe(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "plain", "value": value}
    return {"kind": "other", "type": f"{type(value).__module__}.{type(value).__qualname__}"}


def error_of(call) -> str:
    """``"ValueError"`` if ``call()`` raised one (or a subclass), else what it did instead (the
    other exception, or that it returned): the checks compare with ``"ValueError"`` and show the
    rest."""
    try:
        call()
    except ValueError:
        return "ValueError"
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]
    return "nothing (it returned)"


def plain(value):
    """A returned value as plain data with its type: ``{"t": type name, "v": value}``."""
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if type(value) in (int, float, str):
        return {"t": type(value).__name__, "v": value}
    if isinstance(value, dict):
        return {"t": "dict", "v": {str(k): plain(v) for k, v in value.items()},
                "keys": [type(k).__name__ for k in value]}
    if isinstance(value, (list, tuple)):
        return {"t": type(value).__name__, "v": [plain(v) for v in value]}
    if value is None:
        return {"t": "None", "v": None}
    return {"t": f"{type(value).__module__}.{type(value).__qualname__}"}
