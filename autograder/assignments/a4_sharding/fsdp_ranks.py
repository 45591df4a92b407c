"""What each process of Assignment 4's ``apply_fsdp`` checks runs: the grader's mesh, the
student's ``apply_fsdp`` on a float32 model, what FSDP2's own state then says about every unit
(read from the grader's side: module types, the parameters each unit manages, its mixed
precision policy, whether it reshards after forward) and about every parameter (DTensor,
placements, mesh, local shape), and one forward and backward on this rank's share of a batch.

Trusted harness code like :mod:`.ranks` (which it uses): imports nothing heavier than torch;
FSDP and DTensor are imported where they are used (the sandbox preloads them for the ranks).
"""
from __future__ import annotations

import os

import torch.nn.functional as F

from autograder.checking.probes import describe

from .ranks import fsdp_blocks, make_data, seeded_model, step_rows

#: The mesh dims' names of the 2-D (HSDP) meshes, as the text states them.
HSDP_DIMS = ("replicate", "shard")


def cap_onednn() -> None:
    """Keep oneDNN off AMX before this process's first bf16 product: some virtual machines
    advertise AMX without letting processes use it, and oneDNN's bf16 kernels then die with
    "Illegal instruction" (see ``course.devices.cpu_bf16_ok``); oneDNN reads the cap when it
    first runs. The products here are tiny: the cap costs nothing."""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _reshards(group):
    """A parameter group's ``reshard_after_forward``: False (keeps the gathered parameters),
    True (frees them to its shards), "other" (reshards to a smaller group)."""
    info = group.post_forward_mesh_info
    return False if info is None else True if info is group.mesh_info else "other"


def param_groups(state) -> list:
    """The parameter groups of an FSDP state, as a list: ``_fsdp_param_groups`` (torch 2.12
    and later, a list) or ``_fsdp_param_group`` (torch 2.11, one group or None); a unit
    without parameters has none."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _unit(module, params) -> dict:
    """What FSDP's state says about ``module``: is it a unit; does it manage exactly
    ``params``; its mixed precision policy's dtypes; does it reshard after forward (True,
    False, or "other": resharding to a smaller group)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return {"unit": False}
    state = module._get_fsdp_state()
    groups = param_groups(state)
    managed = {id(fp.sharded_param) for g in groups for fp in g.fsdp_params}
    policy = state._mp_policy
    flags = {_reshards(g) for g in groups}
    reshard = flags.pop() if len(flags) == 1 else None
    return {"unit": True, "owns": managed == {id(p) for p in params},
            "managed": len(managed), "expected": len(params),
            "param_dtype": _dtype_name(policy.param_dtype),
            "reduce_dtype": _dtype_name(policy.reduce_dtype), "reshard": reshard}


def rank_apply_fsdp_case(rank, world_size, i, case, fn, seed, per_rank):
    """Case ``(kind, mesh shape)``: the grader's mesh (``init_device_mesh("cpu", shape)``, the
    2-D one with dims named :data:`HSDP_DIMS`), the float32 model of ``kind`` given to the
    student's ``fn`` (apply_fsdp); its units and parameters as FSDP's state has them; then one
    forward on this rank's share of a batch, the mean squared error of the output cast to
    float32, backward; the output (float64, exact) and each parameter's full gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    cap_onednn()
    kind, shape = case
    mesh = init_device_mesh("cpu", tuple(shape),
                            mesh_dim_names=HSDP_DIMS if len(shape) == 2 else None)
    model = seeded_model(kind, seed + i)
    blocks = fsdp_blocks(kind, model)
    returned = fn(model, mesh)
    # after the call: fully_shard replaces each parameter with a new one (a DTensor)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    units = {"root": _unit(model, outside),
             "blocks": [{**_unit(b, list(b.parameters())),
                         "has_params": any(True for _ in b.parameters())} for b in blocks]}
    made = [{"dtensor": isinstance(p, DTensor),
             "placements": [(type(x).__name__, getattr(x, "dim", None))
                            for x in (p.placements if isinstance(p, DTensor) else ())],
             "on_mesh": bool(isinstance(p, DTensor) and p.device_mesh == mesh),
             "local_shape": list((p.to_local() if isinstance(p, DTensor) else p).shape)}
            for p in model.parameters()]
    X, y = make_data(kind, seed + i, per_rank * world_size)
    rows = step_rows(0, per_rank, world_size, rank)
    output = model(X[rows])
    F.mse_loss(output.float(), y[rows]).backward()
    grads = [None if p.grad is None else
             (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().double()
             for p in model.parameters()]
    return {"returned_model": returned is model, **units, "params": made,
            "output_dtype": _dtype_name(output.dtype),
            "output": describe(output.detach().double()), "grads": describe(grads)}
