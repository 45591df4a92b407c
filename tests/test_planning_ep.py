"""Expert parallelism in `course.planning` (course/planning_moe.py): a Mixtral-8x7B-like model counted
by hand. Quick tier (arithmetic only, well under a second).

Every expected value is computed here from the model's definition (torchtitan's convention: the ep
ranks are dp ranks, the experts split ep ways, each expert's states ZeRO-sharded over the dp / ep
ranks that hold it; 4 all-to-alls of b s top_k h values per MoE layer and micro-batch, (ep-1)/ep of
them off the rank), not by calling the functions under test, and anchored to the published counts
(Mixtral of Experts, Jiang et al. 2024: 47 B parameters, 13 B active). That ep = 1 leaves a dense
model's numbers exactly as they were is what tests/test_toolkit.py's planning tests check: they
pass unchanged.
"""
import pytest

from course import planning

H, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, EXPERTS, TOP_K = 4096, 32, 32, 8, 14336, 32000, 8, 2
SEQ, GPUS, SEQUENCES = 4096, 64, 512
NVLINK, INFINIBAND = 450e9, 50e9

# Mixtral 8x7B's shape (its Table 1), counted from the definition: attention q, o (h x h) and k, v
# (h x 1024), 8 experts of three h x ffn matrices, a router (h x 8) and two norms per layer; a final
# norm; input and output embeddings
KV = KV_HEADS * H // HEADS
EXPERT = 3 * H * FFN
PER_LAYER = 2 * H * H + 2 * H * KV + EXPERTS * EXPERT + H * EXPERTS + 2 * H
TOTAL = LAYERS * PER_LAYER + H + 2 * VOCAB * H
ROUTED = LAYERS * EXPERTS * EXPERT
DENSE = TOTAL - ROUTED
ACTIVE = TOTAL - LAYERS * (EXPERTS - TOP_K) * EXPERT
LINKS = dict(tp_bandwidth=NVLINK, dp_bandwidth=INFINIBAND, pp_bandwidth=INFINIBAND)


def mixtral(capacity_factor=1.0):
    moe = planning.MoE(experts=EXPERTS, top_k=TOP_K, expert_ffn=FFN, moe_layers=LAYERS,
                       capacity_factor=capacity_factor)
    n_params = planning.llama_params(LAYERS, H, HEADS, KV_HEADS, FFN, VOCAB, moe=moe)
    return planning.Model(n_params, LAYERS, H, HEADS, SEQ, vocab=VOCAB, kv_heads=KV_HEADS, moe=moe)


def layout(**kw):
    return planning.Layout(**{"dp": GPUS, "global_batch": SEQUENCES, "recompute": "selective", **kw})


def test_mixtral_total_and_active_parameters():
    model = mixtral()
    assert model.n_params == TOTAL == 46_702_792_704                 # "47B" (46.7 B)
    assert planning.expert_params(model) == ROUTED == 45_097_156_608
    assert planning.active_params(model) == ACTIVE == 12_879_925_248  # "13B" (12.9 B)
    assert round(TOTAL / 1e9, 1) == 46.7 and round(ACTIVE / 1e9, 1) == 12.9
    dense = planning.Model(TOTAL, LAYERS, H, HEADS, SEQ)
    assert planning.expert_params(dense) == 0 and planning.active_params(dense) == TOTAL


def test_memory_per_gpu_with_ep_8_against_ep_1():
    """ZeRO-1 over 64 ranks: bf16 weights and gradients replicated (dense) or split 8 ways (experts);
    the 12 optimizer bytes sharded over 64 ranks either way (dense / 64 + routed / 8 / 8)."""
    model = mixtral()
    one = planning.model_state_memory(model, layout(zero=1))
    eight = planning.model_state_memory(model, layout(zero=1, ep=8))
    assert one["params"] == pytest.approx(2 * TOTAL) and one["grads"] == pytest.approx(2 * TOTAL)
    assert one["optimizer"] == pytest.approx(12 * TOTAL / 64)
    per_gpu = DENSE + ROUTED / 8
    assert eight["params"] == pytest.approx(2 * per_gpu) and eight["grads"] == pytest.approx(2 * per_gpu)
    assert eight["optimizer"] == pytest.approx(12 * (DENSE / 64 + ROUTED / 8 / 8))
    assert eight["optimizer"] == pytest.approx(one["optimizer"])
    # by hand, in GB: 93.41 + 93.41 + 8.76 = 195.6 against 14.49 + 14.49 + 8.76 = 37.7
    assert [round(sum(states.values()) / 1e9, 1) for states in (one, eight)] == [195.6, 37.7]
    # no ZeRO: 16 bytes of every parameter a GPU holds; ZeRO-3: everything over 64 ranks, EP or not
    def states(**kw):
        return sum(planning.model_state_memory(model, layout(**kw)).values())

    assert states(zero=0, ep=8) == pytest.approx(16 * per_gpu)
    assert states(zero=3, ep=1) == pytest.approx(16 * TOTAL / 64) == pytest.approx(states(zero=3, ep=8))
    # tensor and pipeline parallelism split the experts too (etp = tp), 2 x 4 ways
    split = planning.model_state_memory(model, layout(dp=8, tp=2, pp=4, zero=0, ep=8))
    assert split["params"] == pytest.approx(2 * (DENSE / 8 + ROUTED / 8 / 8))
    # activations are counted as for a dense layer, the same with or without EP
    assert (planning.estimate_memory(model, layout(zero=1))["activations"]
            == planning.estimate_memory(model, layout(zero=1, ep=8))["activations"])


def test_all_to_all_seconds_per_step():
    """Per MoE layer and micro-batch: dispatch and combine, forward and backward, each b s top_k h bf16
    values of which 7/8 leave the rank; 32 layers, 512 / 64 = 8 micro-batches per replica."""
    model = mixtral()
    one_all_to_all = 1 * SEQ * TOP_K * H * 2 * 7 / 8                       # 58.7 MB per rank
    per_step = 8 * LAYERS * 4 * one_all_to_all                            # 15.0 GB per rank and step
    buffer = one_all_to_all * 8 / 7                                        # 1/8 of it stays on the rank
    assert planning.alltoall_seconds(buffer, 8, NVLINK) == pytest.approx(one_all_to_all / NVLINK)
    ep8 = layout(zero=1, ep=8)
    assert planning.expert_parallel_seconds(model, ep8, NVLINK) == pytest.approx(per_step / NVLINK)
    assert round(per_step / NVLINK, 3) == 0.134 and round(per_step / INFINIBAND, 2) == 1.20
    step = planning.estimate_step(model, ep8, planning.H100, ep_bandwidth=NVLINK, **LINKS)
    assert step["ep"] == pytest.approx(per_step / NVLINK)
    assert step["total"] == pytest.approx(step["compute"] + step["ep"] + step["exposed_dp"])
    # 6 N of the active parameters, not of all of them
    assert step["compute"] == pytest.approx(6 * ACTIVE * SEQUENCES * SEQ / (GPUS * 989e12 * 0.5))
    # full recomputation runs the forward's two again; padded buffers send cf times the rows; context
    # parallelism halves each rank's tokens (dp 32 x cp 2 keeps 64 GPUs and 8 micro-batches)
    full = layout(zero=1, ep=8, recompute="full")
    assert planning.expert_parallel_seconds(model, full, NVLINK) == pytest.approx(1.5 * per_step / NVLINK)
    padded = planning.expert_parallel_seconds(mixtral(1.25), ep8, NVLINK)
    assert padded == pytest.approx(1.25 * per_step / NVLINK)
    halves = layout(dp=32, cp=2, zero=1, ep=8, global_batch=SEQUENCES // 2)
    assert planning.expert_parallel_seconds(model, halves, NVLINK) == pytest.approx(per_step / 2 / NVLINK)
    assert planning.expert_parallel_seconds(model, layout(zero=1), NVLINK) == 0.0


def test_expert_gradients_reduce_over_the_ranks_that_hold_them():
    """ZeRO-1 with accumulation: one reduce-scatter of the gradients and one all-gather of the weights
    per step, the dense part's over 64 ranks, the experts' (1/8 of them per GPU) over 64 / 8 = 8."""
    model = mixtral()
    dense = 2 * (63 / 64) * 2 * DENSE / INFINIBAND
    experts = 2 * (7 / 8) * 2 * (ROUTED / 8) / INFINIBAND
    traffic, _ = planning.data_parallel_seconds(model, layout(zero=1, ep=8), 1.0, INFINIBAND)
    assert traffic == pytest.approx(dense + experts)
    without, _ = planning.data_parallel_seconds(model, layout(zero=1), 1.0, INFINIBAND)
    assert without == pytest.approx(2 * (63 / 64) * 2 * TOTAL / INFINIBAND)


def test_ep_must_fit_the_layout():
    model, dense = mixtral(), planning.Model(TOTAL, LAYERS, H, HEADS, SEQ)
    for bad_model, bad in [(model, layout(ep=3)),                      # does not divide 64
                           (model, layout(dp=16, ep=16, global_batch=16)),  # 16 does not divide 8 experts
                           (model, layout(dp=4, ep=8, global_batch=4)),     # more than dp x cp
                           (dense, layout(ep=2))]:                     # a dense model has no experts
        with pytest.raises(ValueError, match="ep"):
            planning.estimate_memory(bad_model, bad)
    with pytest.raises(ValueError, match="ep_bandwidth"):
        planning.estimate_step(model, layout(ep=8), planning.H100, **LINKS)
