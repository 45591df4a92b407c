"""Helpers for probes (child side) and for judging what they return (grader side).

Probes run beside student code and only *collect*: they look a function up, call it, and
describe what came back as plain data. Judging happens in the grader with :func:`tensor`
and friends, which re-check types there because nothing from the child is trusted.
"""
from __future__ import annotations

import contextlib
import inspect
import secrets

import torch

# ------------------------------------------------------------------ child side (probes)


def student_function(ns: dict, name: str, params: list[str]):
    """The student's function ``name``, or a clear error if it is missing or takes other arguments."""
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


@contextlib.contextmanager
def reference_helpers(fn, cells: list[tuple[str, str]] | None, names: list[str]):
    """While inside, the names ``fn`` looks up globally are the reference versions (when
    ``cells`` are given), so a check grades ``fn`` alone; the student's are put back after."""
    if not cells:
        yield
        return
    reference: dict = {"__name__": "__reference__"}
    for _, source in cells:
        exec(compile(source, "<reference>", "exec"), reference)
    g = fn.__globals__
    saved = {n: g[n] for n in names if n in g}
    g.update({n: reference[n] for n in names if n in reference})
    try:
        yield
    finally:
        for n in names:
            g.pop(n, None)
        g.update(saved)


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


# ------------------------------------------------------------------ grader side (judging)


def fresh_generator() -> tuple[torch.Generator, int]:
    """A generator seeded anew on every run, so remembered answers cannot pass."""
    seed = secrets.randbits(31)
    return torch.Generator().manual_seed(seed), seed


def tensor(desc, what: str) -> dict:
    """Assert ``desc`` describes a plain ``torch.Tensor``; return the description."""
    assert isinstance(desc, dict), f"{what}: the probe's reply was tampered with"
    if desc.get("kind") == "other":
        raise AssertionError(f"{what} should be a torch.Tensor, got {desc.get('type')}")
    if desc.get("kind") != "tensor":
        got = desc.get("kind") if desc.get("kind") != "plain" else type(desc.get("value")).__name__
        raise AssertionError(f"{what} should be a torch.Tensor, got {got}")
    assert type(desc["value"]) is torch.Tensor, f"{what} is not a plain torch.Tensor"
    return desc


def sequence(desc, what: str, length: int | None = None) -> list:
    """Assert ``desc`` describes a list or tuple (of ``length`` items); return its items."""
    assert isinstance(desc, dict), f"{what}: the probe's reply was tampered with"
    if desc.get("kind") not in ("list", "tuple"):
        got = desc.get("type") or desc.get("kind")
        if desc.get("kind") == "plain":
            got = type(desc.get("value")).__name__
        raise AssertionError(f"{what} should be a list, got {got}")
    items = desc["items"]
    if length is not None:
        assert len(items) == length, f"{what} should have {length} item(s), got {len(items)}"
    return items


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, *,
                 rtol: float = 1e-5, atol: float = 1e-6, seed: int | None = None) -> None:
    """Shape, dtype and values, with a message that says where they differ."""
    where = f" (inputs from seed {seed})" if seed is not None else ""
    assert type(actual) is torch.Tensor, f"{what} is not a plain torch.Tensor"
    assert actual.shape == expected.shape, \
        f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}{where}"
    assert actual.dtype == expected.dtype, \
        f"{what} has dtype {actual.dtype}, expected {expected.dtype}{where}"
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=False):
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{what} has wrong values: largest difference {diff:.3g}{where}")
