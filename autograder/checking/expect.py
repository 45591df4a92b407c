"""What checks use to judge, in the grader: fresh inputs from the run's seed, and assertions
on what probes returned, which re-check types here because nothing from the child is trusted.
Tolerances come from the computation: :func:`float32_tolerance` derives one from a float64
reference and a float32 run of the same computation.
"""
from __future__ import annotations

import random
import secrets

import torch

_run = {"rng": random.Random(secrets.randbits(63)), "seed": None}


def devices_for(n: int) -> list[str]:
    """``n`` devices: distinct GPUs where there are enough, else CPU stand-ins."""
    from course.devices import gpu_count

    return [f"cuda:{i}" for i in range(n)] if gpu_count() >= n else ["cpu"] * n


def set_run_seed(seed: int | None) -> int:
    """Seed every :func:`fresh_generator` of this run (a new random seed when None); returns
    the seed, which the report prints so that ``--seed`` repeats the same inputs."""
    seed = secrets.randbits(31) if seed is None else int(seed)
    _run.update(rng=random.Random(seed), seed=seed)
    return seed


def fresh_generator() -> tuple[torch.Generator, int]:
    """A generator with a seed drawn from the run's seed: new inputs every run (remembered
    answers cannot pass), the same ones again under the same ``--seed``."""
    seed = _run["rng"].getrandbits(31)
    return torch.Generator().manual_seed(seed), seed

def shared_rank_replies(student, key: str, world: int, probe, args_of) -> tuple[int, list]:
    """``(seed, replies)`` of one run of a multi-process ``probe`` on a fresh seed, shared by
    every check that asks for ``key`` (one launch judged by all of a function's checks):
    ``args_of(seed)`` gives the probe's arguments, and the reply must hold one dict per rank of
    ``world``."""
    def run():
        _, seed = fresh_generator()
        replies = student.call(probe, *args_of(seed))
        assert isinstance(replies, list) and len(replies) == world and \
            all(isinstance(r, dict) for r in replies), "the probe's reply was tampered with"
        return seed, replies
    return student.shared(key, run)


#: What :func:`~autograder.checking.probes.describe` names an ``nn.Parameter`` (and the lazy
#: modules' parameter before its first call).
_PARAMETERS = {"torch.nn.parameter.Parameter", "torch.nn.parameter.UninitializedParameter"}


def tensor(desc, what: str) -> dict:
    """Assert ``desc`` describes a plain ``torch.Tensor``; return the description."""
    assert isinstance(desc, dict), f"{what}: the probe's reply was tampered with"
    if desc.get("kind") == "other":
        if desc.get("type") in _PARAMETERS:  # a Parameter is a tensor: say what is wrong with it
            raise AssertionError(
                f"{what} is an nn.Parameter; the grader takes plain tensors only: return e.g. "
                "p.detach(), or a new tensor with requires_grad=True where the text asks for it")
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


def float32_tolerance(reference64: torch.Tensor, reference32: torch.Tensor, *,
                      factor: float = 16.0) -> float:
    """An absolute tolerance for a float32 result of a computation, from that computation:
    ``factor`` times how far a float32 run of the trusted reference strays from its float64 run
    (float32 code that sums in another order strays by the same order of magnitude), and never
    less than a few float32 roundings of the result's magnitude."""
    eps = torch.finfo(torch.float32).eps
    stray = (reference32.double() - reference64.double()).abs().max().item() if reference64.numel() else 0.0
    scale = reference64.double().abs().max().item() if reference64.numel() else 0.0
    return factor * max(stray, 4 * eps * max(scale, 1e-3))


def float32_tolerance_of_all(references64: list, references32: list, **kwargs) -> float:
    """One :func:`float32_tolerance` for all the results of one computation (every parameter
    after training). Why: per tensor, the float32 reference's stray is a noisy estimate; one
    parameter's float32 run can land by chance much closer to float64 than correct code that
    sums in another order (the A2 reference lost train_ddp's points that way at one seed). The
    largest stray over the whole computation bounds every tensor of it."""
    flat64 = [t.double().flatten() for t in references64 if t is not None]
    flat32 = [t.double().flatten() for t in references32 if t is not None]
    if not flat64:
        return 0.0
    return float32_tolerance(torch.cat(flat64), torch.cat(flat32), **kwargs)


def assert_close_float32(actual: torch.Tensor, reference64: torch.Tensor,
                         reference32: torch.Tensor, what: str, *, seed: int | None = None,
                         tol: float | None = None) -> None:
    """``actual`` (float32) against the float64 truth, within :func:`float32_tolerance` (or
    ``tol``, e.g. :func:`float32_tolerance_of_all` for a whole computation).

    The comparison is made in float64: a float result of another dtype (float64, float16,
    bfloat16) is cast **up** to float64, never the truth down to the result's dtype. The truth
    cast down to an integer dtype is mostly zeros (a LeNet weight below 1 truncates to 0), so
    int64 zeros would have "matched" a training step that trained nothing; an integer, bool or
    complex tensor is no result of a float computation and fails on its dtype. No assignment
    text states float32 for a result judged here, so a float64 one is judged on its values."""
    where = f" (inputs from seed {seed})" if seed is not None else ""
    assert type(actual) is torch.Tensor, f"{what} is not a plain torch.Tensor"
    expected_dtype = reference32.dtype
    if not actual.is_floating_point():
        raise AssertionError(
            f"{what} has dtype {actual.dtype}, expected {expected_dtype} (a floating-point "
            f"tensor: converting the result to {actual.dtype} loses its values){where}")
    tol = float32_tolerance(reference64, reference32) if tol is None else tol
    if actual.dtype != expected_dtype:
        what = f"{what} (returned as {actual.dtype}, compared in float64)"
    assert_close(actual.double(), reference64.double(), what, rtol=0, atol=tol, seed=seed)
