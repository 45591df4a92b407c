"""Mixture-of-experts models and expert parallelism (EP) for `course.planning` (lesson 16).

`course.planning` imports these (and re-exports them): a `Model` may carry an `MoE`, a `Layout`
an `ep` degree. The convention modelled is torchtitan's, which DeepSeek-V3 and Megatron-LM share:
EP has no GPUs of its own; its ep ranks are some of the dp x cp ranks that already share the
dense weights, each of them holding experts / ep of the routed experts (lesson 15, section 8).
So per GPU the dense part is as before and the experts' weights, gradients and optimizer state
are divided by ep (`state_groups`), the FLOPs count the active parameters only (`active_params`),
and every MoE layer adds all-to-alls on the critical path (`expert_parallel_seconds`). Sources,
cited below by key:

[torchtitan]  https://github.com/pytorch/torchtitan, torchtitan/distributed/parallel_dims.py:
              "EP would borrow all cp and some dp_shard degree" (with etp = tp: the experts are
              split over tp as well; (dp_shard x cp) % ep == 0), and the experts are FSDP-sharded
              over the dp_shard x cp / ep ranks that hold the same ones. With tp, its models'
              parallelize plans all-gather the MoE input over tp (PrepareModuleInputOutput to
              Replicate) and ExpertTensorParallel (distributed/expert_parallel.py) dispatches it
              over the ep group: every tp rank sends the same tokens.
[Mixtral]     A. Q. Jiang et al., "Mixtral of Experts", 2024, https://arxiv.org/abs/2401.04088:
              section 2 and Table 1 (8 SwiGLU experts of width 14336, 2 per token, in all 32
              layers; 47 B parameters, 13 B active per token).
[DeepSeekV3]  DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, https://arxiv.org/abs/2412.19437:
              sections 2.1.2 and 4.2 (256 routed experts of width 2048 and 1 shared, 8 per token, in
              58 of 61 layers; 671 B parameters, 37 B active), 3.2 (PP 16 and EP 64 over 8 nodes
              inside ZeRO-1 data parallelism; dispatch and combine all-to-alls; cross-node EP makes
              computation and communication about 1 : 1).
[Switch]      W. Fedus et al., "Switch Transformers", JMLR 2022, https://arxiv.org/abs/2101.03961:
              section 2.2 (expert capacity: a capacity factor times the even share of tokens).
[NCCL]        NCCL tests, https://github.com/NVIDIA/nccl-tests, src/alltoall.cu: an all-to-all's
              bus bandwidth is (n-1)/n of its algorithm bandwidth: (n-1)/n of a rank's buffer
              crosses its link.
"""
from __future__ import annotations

from dataclasses import dataclass

# `model` and `layout` below are course.planning's Model and Layout; this module does not import
# course.planning (which imports it), so they go without annotations.


@dataclass(frozen=True)
class MoE:
    """The mixture-of-experts layers of a `Model`: `moe_layers` of its layers replace the MLP by
    `experts` routed SwiGLU experts (three hidden x `expert_ffn` matrices each) and `shared` shared
    ones that every token passes (dense parameters: data-parallel, no all-to-all); the router sends
    each token to `top_k` routed experts ([Mixtral] 2, [DeepSeekV3] 2.1.2). `capacity_factor`
    scales the rows each of a token's choices sends: 1 for dropless dispatch (torchtitan,
    DeepSeek-V3), cf for buffers padded to cf times the even share ([Switch] 2.2): an average over
    tokens, not any batch's whole-number capacity."""
    experts: int
    top_k: int
    expert_ffn: int
    moe_layers: int
    shared: int = 0
    capacity_factor: float = 1.0


def expert_params(model) -> float:
    """Parameters of the routed experts: moe_layers x experts x 3 h expert_ffn; 0 for a dense model."""
    moe = model.moe
    return 0 if moe is None else moe.moe_layers * moe.experts * 3 * model.hidden * moe.expert_ffn


def active_params(model) -> float:
    """Parameters one token passes through: all but the routed experts it is not sent to,
    n_params - moe_layers (experts - top_k) 3 h expert_ffn ([Mixtral]: 13 B of 47 B; [DeepSeekV3]:
    37 B of 671 B); n_params for a dense model. `course.planning.training_flops` counts these."""
    moe = model.moe
    if moe is None:
        return model.n_params
    return model.n_params - moe.moe_layers * (moe.experts - moe.top_k) * 3 * model.hidden * moe.expert_ffn


def state_groups(model, layout) -> list[tuple[float, int]]:
    """(parameters per GPU, ranks that share and ZeRO-shard them), for the dense part and for the
    routed experts: [(n_dense / (tp x pp), dp x cp), (n_experts / (tp x pp x ep), dp x cp / ep)].

    [torchtitan]'s convention: the ep ranks are dp x cp ranks, so ep must divide dp x cp (and the
    experts); the experts are split over tp like the dense layers (etp = tp) and evenly over the
    pipeline stages, and the dp x cp / ep ranks that hold the same experts shard their states.
    (torchtitan also wants ep to be a multiple of cp; these formulas do not need it.)"""
    ep, shards = layout.ep, layout.dp * layout.cp
    if ep < 1 or shards % ep or (ep > 1 and (model.moe is None or model.moe.experts % ep)):
        experts = "none: a dense model" if model.moe is None else model.moe.experts
        raise ValueError(f"ep = {ep} must divide dp x cp = {shards} and the number of experts ({experts})")
    experts = expert_params(model)
    split = layout.tp * layout.pp
    return [((model.n_params - experts) / split, shards), (experts / (split * ep), shards // ep)]


def alltoall_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """All-to-all of a rank's `nbytes`, 1/n of it for each rank: the (n-1)/n that leave the rank go
    out (and as much comes in) at `bandwidth` bytes/s per direction ([NCCL]); no latency term."""
    return (n - 1) / n * nbytes / bandwidth


def expert_parallel_seconds(model, layout, bandwidth: float, bytes_per_value: float = 2) -> float:
    """Seconds of one step's expert-parallel all-to-alls on one GPU (0 with ep = 1).

    Per MoE layer and micro-batch, the dispatch (each token's copies to their experts) and the
    combine (the experts' outputs back) in the forward, and their gradients the reverse ways in the
    backward: 4 all-to-alls, 6 with full recomputation, which runs the forward's again ([DeepSeekV3]
    3.2; lesson 15). Each carries top_k copies of every token's h values, times the capacity
    factor: b (s / cp) top_k cf h x `bytes_per_value` bytes, of which (ep - 1) / ep leave the rank
    under even routing (`alltoall_seconds`). With tp, every tp rank dispatches the same tokens
    ([torchtitan] ExpertTensorParallel). moe_layers / pp MoE layers per stage; on the critical
    path (no overlap with computation, which DeepSeek-V3's DualPipe schedule arranges).
    `bandwidth` is per GPU and direction, on the slowest link the ep group crosses."""
    state_groups(model, layout)
    if layout.ep == 1:
        return 0.0
    moe = model.moe
    copies = layout.micro_batch * model.seq / layout.cp * moe.top_k * moe.capacity_factor
    per_layer = (6 if layout.recompute == "full" else 4) * alltoall_seconds(
        copies * model.hidden * bytes_per_value, layout.ep, bandwidth)
    return moe.moe_layers / layout.pp * layout.micro_batches * per_layer
