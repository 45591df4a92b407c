"""Back-of-the-envelope models of a parallel training step: memory per GPU and seconds per step.

Lesson 16 plans data x context x tensor x pipeline (x expert) parallel runs with them and checks
the memory model against CPU processes. Each function states its formula and where it comes from;
they are the published approximations, not a simulator (no latency, no kernel launch, no
fragmentation, no load imbalance). Sources, cited below by key:

[ZeRO]        S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
              Models", SC 2020, https://arxiv.org/abs/1910.02054: section 3.1 (mixed-precision Adam
              keeps 2 + 2 + K bytes per parameter, K = 12), section 5 and Figure 1 (the three
              stages), section 7 (their communication volume).
[Korthikanti] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
              Models", MLSys 2023, https://arxiv.org/abs/2205.05198: section 4 and Table 2
              (activation bytes per layer; tensor and sequence parallelism), 4.2.3 (the first
              pipeline stage holds p micro-batches; with v interleaved stages per rank, which the
              paper calls m, 1 + (p - 1) / (p v) times that), 4.3 (the output layer: 4 s b h / t
              x (1 + V / h) bytes, V the vocabulary, the logits kept in fp32 for the loss),
              section 5 (selective recomputation).
[Narayanan]   D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
              Using Megatron-LM", SC 2021, https://arxiv.org/abs/2104.04473: section 2.2 (the
              pipeline bubble, 1F1B and interleaving), section 3 (tensor parallelism's all-reduces);
              its code, megatron/core/pipeline_parallel/schedules.py (the interleaved schedule's
              warm-up: 2 (p - r - 1) + (v - 1) p forwards of one model chunk on rank r).
[ZeroBubble]  P. Qi et al., "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024,
              https://arxiv.org/abs/2401.10241: section 2 (the backward split into B, the input
              gradient, and W, the weight gradient; ZB-H1 has 1F1B's peak memory and a bubble of
              (p - 1)(T_F + T_B - T_W), against 1F1B's (p - 1)(T_F + T_B + T_W)).
[Kaplan]      J. Kaplan et al., "Scaling Laws for Neural Language Models", 2020,
              https://arxiv.org/abs/2001.08361: section 2.1 and Table 1 (a forward costs 2N +
              2 n_layer n_ctx d_attn FLOPs a token, training three times that: 6N without the
              context term).
[Llama3]      Llama Team, AI @ Meta, "The Llama 3 Herd of Models", 2024,
              https://arxiv.org/abs/2407.21783: section 3.3.2 (context parallelism by all-gathering
              K and V in the forward and reduce-scattering their gradients in the backward; one
              layer fewer on the first and the last pipeline stage).
[torchtitan]  https://github.com/pytorch/torchtitan, torchtitan/distributed/parallel_dims.py: FSDP
              shards over the data-parallel and the context-parallel ranks together ("dp_shard_cp");
              expert parallelism's ranks are some of those (course.planning_moe).
[Playbook]    N. Tazi et al., "The Ultra-Scale Playbook", Hugging Face, 2025,
              https://huggingface.co/spaces/nanotron/ultrascale-playbook (the same formulas, and
              parameters spread evenly over tp x pp).
[NCCL]        NCCL tests, doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests: a ring
              all-reduce moves 2(n-1)/n of the buffer through each rank's link, all-gather and
              reduce-scatter (n-1)/n.
Mixture-of-experts models and expert parallelism: course.planning_moe (its own sources).
"""
from __future__ import annotations

from dataclasses import dataclass

from course.planning_moe import (MoE, active_params, alltoall_seconds, expert_params,  # noqa: F401
                                  expert_parallel_seconds, state_groups)

SCHEDULES = ("1f1b", "gpipe", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
STAGES = ("first", "last")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of weights, gradients and optimizer state; bytes per activation value."""
    param: float
    grad: float
    optimizer: float
    activation: float


#: bf16 weights and gradients, fp32 master weights and Adam's two moments: 2 + 2 + 12 = 16 bytes
#: per parameter ([ZeRO] 3.1, K = 12); bf16 activations ([Korthikanti]'s counts assume 2 bytes).
MIXED = Precision(param=2, grad=2, optimizer=12, activation=2)
#: Adam in float32 (the CPU runs): no separate master copy, also 16 bytes per parameter.
FP32 = Precision(param=4, grad=4, optimizer=8, activation=4)
#: Adam in float64 (lesson 16's exact comparisons).
FP64 = Precision(param=8, grad=8, optimizer=16, activation=8)


@dataclass(frozen=True)
class Hardware:
    """One accelerator: peak dense FLOP/s, memory in bytes, bandwidth per direction in bytes/s."""
    name: str
    flops: float
    memory: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int


#: NVIDIA H100 SXM (datasheet): about 989 TFLOP/s dense bf16, 80 GB, NVLink 900 GB/s both
#: directions together (450 GB/s each way), 8 per node, one 400 Gb/s (50 GB/s) InfiniBand
#: adapter per GPU in a DGX H100.
H100 = Hardware("H100 SXM", 989e12, 80e9, 450e9, 50e9, 8)


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer: parameters, layers, hidden size, attention heads, sequence length,
    and optionally the vocabulary (0: the output layer's activations are left out), the key-value
    heads of grouped-query attention (0: as many as `heads`) and its mixture-of-experts layers
    (None: dense). `n_params` counts every parameter, all experts included."""
    n_params: float
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 0
    kv_heads: int = 0
    moe: MoE | None = None


@dataclass(frozen=True)
class Layout:
    """How a step is spread: parallel degrees, ZeRO stage, batch in sequences, schedule, recomputation."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1       # sequences per micro-batch
    global_batch: int = 1      # sequences per optimizer step, all dp ranks together
    schedule: str = "1f1b"     # "1f1b", "gpipe" or "zb-h1" [ZeroBubble]
    interleave: int = 1        # model chunks (virtual stages) per pipeline rank [Narayanan] 2.2.2
    sp: bool = False           # sequence parallelism with tp [Korthikanti]
    recompute: str = "none"    # "none", "selective" (attention core) or "full" (whole layers)
    cp: int = 1                # context parallelism: each sequence split over cp ranks [Llama3]
    ep: int = 1                # expert parallelism: the experts split over ep of the dp x cp ranks

    @property
    def gpus(self) -> int:
        """dp x cp x tp x pp: the ep ranks are dp x cp ranks too ([torchtitan])."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per dp rank and step: global_batch / (dp * micro_batch), a whole number.
        (The cp ranks of a group share their sequences, each holding a piece of every one.)"""
        per_rank, rest = divmod(self.global_batch, self.dp * self.micro_batch)
        if rest or not per_rank:
            raise ValueError(f"global_batch {self.global_batch} is not a multiple of dp x micro_batch "
                             f"= {self.dp * self.micro_batch}")
        return per_rank


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 moe: MoE | None = None) -> int:
    """Parameters of a Llama-style model: grouped-query attention (q and o: h x h; k and v:
    h x kv_heads * h / heads), a SwiGLU MLP (three h x ffn matrices), two RMSNorm weights per
    layer, a final norm, and untied input and output embeddings (V x h each); no biases. With
    `moe`, its moe_layers layers have instead a router (h x experts) and experts + shared SwiGLU
    experts of width expert_ffn (Mixtral's shape; course.planning_moe)."""
    kv = kv_heads * hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    total = layers * per_layer + hidden + 2 * vocab * hidden
    if moe is not None:
        experts = (moe.experts + moe.shared) * 3 * hidden * moe.expert_ffn + hidden * moe.experts
        total += moe.moe_layers * (experts - 3 * hidden * ffn)
    return total


def model_state_memory(model: Model, layout: Layout, precision: Precision = MIXED) -> dict:
    """Bytes of weights, gradients and optimizer state on one GPU of `layout`, by component
    (floats: an average over the GPUs, not a count of any one rank's elements).

    The model's parameters are spread evenly over tp x pp ([Playbook], embeddings included),
    Psi = model.n_params / (tp x pp) per GPU, then ZeRO shards over the Nd = dp x cp ranks that
    hold the same parameters ([ZeRO] Figure 1, K optimizer bytes per parameter; the cp ranks
    shard too, as in [torchtitan]): stage 0 (plain data parallel) (2 + 2 + K) Psi; stage 1
    shards the optimizer state, 2 Psi + 2 Psi + K Psi / Nd; stage 2 the gradients too,
    2 Psi + (2 + K) Psi / Nd; stage 3 the weights too, (2 + 2 + K) Psi / Nd.
    `precision` replaces the 2, 2 and K. With expert parallelism the same holds for each of
    `state_groups`' two parts, added: the dense Psi over Nd, the experts' Psi / ep over Nd / ep.
    """
    zero = layout.zero
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, not {zero}")
    groups = state_groups(model, layout)
    return {name: sum(psi * nbytes / (shards if zero >= stage else 1) for psi, shards in groups)
            for name, nbytes, stage in [("params", precision.param, 3), ("grads", precision.grad, 2),
                                        ("optimizer", precision.optimizer, 1)]}


def activation_bytes(seq: int, batch: int, hidden: int, heads: int, layers: float = 1, *, tp: int = 1,
                     sp: bool = False, recompute: str = "none", bytes_per_value: float = 2,
                     cp: int = 1) -> float:
    """Bytes a forward keeps for backward in `layers` transformer layers, for `batch` sequences.

    [Korthikanti] section 4 and Table 2, per layer, s = seq, b = batch, h = hidden, a = heads,
    t = tp, in bytes with 2-byte activations and 1-byte dropout masks:
      no parallelism            s b h (34 + 5 a s / h)
      tensor parallel           s b h (10 + 24 / t + 5 a s / (h t))
      tensor + sequence par.    s b h (34 + 5 a s / h) / t
      selective recomputation   the 5 a s / h term (attention's s x s matrices) is recomputed
      full recomputation        2 s b h (only each layer's input is kept)
    The 34 counts 16 values per token and hidden unit (2 bytes each) and two dropout masks; the
    5 a s / h counts the softmax's output and its dropout (2 bytes each) and that dropout's mask:
    attention that stores its s x s maps. A fused (FlashAttention-style) kernel stores none;
    "selective" is its count. With context parallelism each of the cp ranks keeps s / cp of the
    tokens (s b h / cp), each with scores against all s keys (the 5 a s / h keeps the whole s).
    `bytes_per_value` / 2 scales everything (masks included: an approximation for other dtypes).
    An MoE layer is counted as a dense one (its experts' activations are not modelled); expert
    parallelism leaves the count as it is, each rank receiving as many token copies as it sends.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}")
    sbh = seq / cp * batch * hidden
    attention = 0 if recompute == "selective" else 5 * heads * seq / hidden
    if recompute == "full":
        per_layer = 2 * sbh
    elif sp or tp == 1:
        per_layer = sbh * (34 + attention) / tp
    else:
        per_layer = sbh * (10 + 24 / tp + attention / tp)
    return layers * per_layer * bytes_per_value / 2


def output_layer_bytes(seq: int, batch: int, hidden: int, vocab: int, *, tp: int = 1, cp: int = 1,
                       bytes_per_value: float = 2) -> float:
    """Bytes the final norm, the output layer and the loss keep for backward, for `batch` sequences:
    4 s b h / t x (1 + V / h), V = vocab ([Korthikanti] 4.3, with sequence parallelism: the norm's
    and the projection's inputs, 2 s b h each, and the logits in fp32 for the cross entropy,
    4 s b V, split over the tp ranks by the vocabulary; with context parallelism each rank keeps
    s / cp of the tokens). For Llama 3's 128,256-token vocabulary that is 4.3 GB per 8192-token
    sequence at h = 4096, more than three of its layers with fused attention. It lives on the
    last pipeline stage only. `bytes_per_value` / 2 scales it."""
    return 4 * seq / cp * batch * hidden / tp * (1 + vocab / hidden) * bytes_per_value / 2


def first_stage_in_flight(pp: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B starts backward once the pipeline
    is full: the first stage holds p, or m if there are fewer ([Narayanan] 2.2.1,
    [Korthikanti] 4.2.3: with L / p layers and p micro-batches the first stage holds L layers'
    worth). ZB-H1 keeps 1F1B's peak ([ZeroBubble] 2)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}")
    return micro_batches if schedule == "gpipe" else min(pp, micro_batches)


def stage_in_flight(layout: Layout, stage: str = "first") -> float:
    """Micro-batches' worth of a stage's L / pp layers that the first or the last pipeline rank
    holds at its peak.

    Without interleaving: the first rank `first_stage_in_flight`, the last one micro-batch (all m
    under GPipe). With v = `interleave` > 1 model chunks of L / (p v) layers per rank (1F1B only),
    rank r warms up with 2 (p - r - 1) + (v - 1) p chunk forwards and holds one more ([Narayanan]'s
    code), at most m v: the first rank (v p + p - 1) / v = p (1 + (p - 1) / (p v)) micro-batches'
    worth ([Korthikanti] 4.2.3), the last ((v - 1) p + 1) / v."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}")
    pp, m, v = layout.pp, layout.micro_batches, layout.interleave
    if v < 1 or (v > 1 and layout.schedule != "1f1b"):
        raise ValueError("interleave must be 1, or more with the 1f1b schedule")
    if v == 1:
        if stage == "first":
            return first_stage_in_flight(pp, m, layout.schedule)
        return m if layout.schedule == "gpipe" else 1
    r = 0 if stage == "first" else pp - 1
    return min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) / v


def estimate_memory(model: Model, layout: Layout, precision: Precision = MIXED, stage: str = "first") -> dict:
    """Bytes per GPU of the first (by default) or the last pipeline stage: model states
    (`model_state_memory`: n_params / (tp x pp) parameters sharded by ZeRO over dp x cp), the
    activations of L / pp layers times `stage_in_flight` micro-batches, and on the last stage the
    output layer's (`output_layer_bytes`; 0 where model.vocab is 0) for one micro-batch, whose
    backward starts as soon as its loss is known (all m under GPipe). With pp = 1 the one stage
    is both."""
    states = model_state_memory(model, layout, precision)
    in_flight = stage_in_flight(layout, stage)
    states["activations"] = in_flight * activation_bytes(
        model.seq, layout.micro_batch, model.hidden, model.heads, model.layers / layout.pp, tp=layout.tp,
        sp=layout.sp, recompute=layout.recompute, bytes_per_value=precision.activation, cp=layout.cp)
    last = stage == "last" or layout.pp == 1
    # the last chunk's backward follows its forward at once, except under GPipe
    outputs = layout.micro_batches if layout.schedule == "gpipe" else 1
    states["output"] = outputs * output_layer_bytes(
        model.seq, layout.micro_batch, model.hidden, model.vocab, tp=layout.tp, cp=layout.cp,
        bytes_per_value=precision.activation) if last and model.vocab else 0.0
    states["total"] = sum(states.values())
    return states


def training_flops(n_params: float, tokens: float, recompute: str = "none") -> float:
    """FLOPs of forward and backward without attention's context term: 2N per token forward, 4N
    backward, 6N in all ([Kaplan] 2.1). Full recomputation runs the forward twice: 8N
    ([Korthikanti] section 5). For a mixture of experts N is `active_params`."""
    return (8 if recompute == "full" else 6) * n_params * tokens


def attention_flops(layers: int, hidden: int, seq: int, tokens: float, recompute: str = "none") -> float:
    """The context term that `training_flops` leaves out: [Kaplan] Table 1's 2 n_layer n_ctx d_attn
    FLOPs a token forward with n_ctx = seq and d_attn = hidden (which is also what both of a
    causal attention's products, the scores and their weighted sum, cost at 2 h FLOPs per query
    and key each over the s / 2 keys a query sees on average), three times that for forward and
    backward (four with full recomputation), for `tokens` tokens. Its ratio to 6N grows with the
    sequence: for a 405B model (126 layers, hidden 16,384) 4 % at 8,192 tokens, 67 % at 131,072."""
    return (8 if recompute == "full" else 6) * layers * seq * hidden * tokens


def allreduce_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: each rank's link carries 2 (n-1)/n nbytes
    ([NCCL], "bus bandwidth"); at `bandwidth` bytes/s, no latency term."""
    return 2 * (n - 1) / n * nbytes / bandwidth


def allgather_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` whole: (n-1)/n nbytes per link ([NCCL])."""
    return (n - 1) / n * nbytes / bandwidth


def pipeline_bubble(pp: int, micro_batches: int, interleave: int = 1, schedule: str = "1f1b") -> float:
    """Idle time of a pipeline flush relative to the ideal compute time: (p - 1) / m for GPipe and
    1F1B, (p - 1) / (v m) with v interleaved stages per rank ([Narayanan] 2.2.1 and 2.2.2); ZB-H1
    (no interleaving) (p - 1) / (3 m): the bubble (p - 1)(T_F + T_B - T_W) against 1F1B's
    (p - 1)(T_F + T_B + T_W), with forward, input gradient and weight gradient a third of the
    compute each, as in 6N ([ZeroBubble] 2)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}")
    if interleave > 1 and schedule != "1f1b":
        raise ValueError("interleave must be 1, or more with the 1f1b schedule")
    return (pp - 1) / (interleave * micro_batches) / (3 if schedule == "zb-h1" else 1)


def data_parallel_seconds(model: Model, layout: Layout, compute: float, bandwidth: float,
                          precision: Precision = MIXED) -> tuple[float, float]:
    """Seconds of one step's data-parallel traffic over the dp x cp ranks that share parameters,
    and the part of them that no computation hides: (traffic, exposed). With expert parallelism
    the experts' collectives run over the dp x cp / ep ranks that hold the same experts, at the same
    `bandwidth`, after the dense ones (`state_groups`); their seconds add to G and W below.

    With gradient accumulation over the m micro-batches ([ZeRO] 5 and 7 for the collectives;
    G, W: the gradients' and the weights' bytes of n_params / (tp x pp) parameters; each
    micro-batch computes for compute / m, its backward for the backward's share of that, 2/3,
    3/4 with full recomputation):
      stage 0, 1  the gradients accumulate locally (DDP's `no_sync`) and are reduced once: an
                  all-reduce (stage 1: a reduce-scatter, then an all-gather of the updated
                  weights), hidden at most behind the last micro-batch's backward;
      stage 2     only a shard of the gradients is kept, so every micro-batch's are
                  reduce-scattered, each behind its own backward; the all-gather of the updated
                  weights comes with the last;
      stage 3     every micro-batch gathers the weights again, in its forward and in its backward,
                  and reduce-scatters its gradients: 1.5 all-reduces' bytes per micro-batch, each
                  behind that micro-batch's forward and backward.
    """
    n, m = layout.dp * layout.cp, layout.micro_batches
    groups = state_groups(model, layout)
    if n == 1:
        return 0.0, 0.0
    gather_w = sum(allgather_seconds(psi * precision.param, shards, bandwidth) for psi, shards in groups)
    scatter_g = sum(allgather_seconds(psi * precision.grad, shards, bandwidth) for psi, shards in groups)
    per_micro = compute / m
    backward = per_micro * (1 - (2 / 8 if layout.recompute == "full" else 2 / 6))
    if layout.zero in (0, 1):
        traffic = scatter_g + gather_w
        return traffic, max(0.0, traffic - backward)
    if layout.zero == 2:
        traffic = m * scatter_g + gather_w
        return traffic, (m - 1) * max(0.0, scatter_g - backward) + max(0.0, scatter_g + gather_w - backward)
    traffic = m * (2 * gather_w + scatter_g)
    return traffic, m * max(0.0, 2 * gather_w + scatter_g - per_micro)


def estimate_step(model: Model, layout: Layout, hardware: Hardware, *, tp_bandwidth: float,
                  dp_bandwidth: float, pp_bandwidth: float, cp_bandwidth: float | None = None,
                  ep_bandwidth: float | None = None, efficiency: float = 0.5, precision: Precision = MIXED,
                  overlap_dp: bool = True, attention: bool = False) -> dict:
    """Seconds of one optimizer step on every GPU, by part, and the model FLOPs utilization.

    compute  training_flops of active_params (plus attention_flops with `attention`) / (GPUs x
             peak x efficiency): `efficiency` is the fraction of peak the kernels reach, an
             assumption to state; an MoE's experts are assumed evenly loaded;
    bubble   compute x pipeline_bubble(pp, m, interleave, schedule);
    tp       per layer and micro-batch, 2 all-reduces forward and 2 backward of the (b, s / cp, h)
             activation ([Narayanan] 3; sequence parallelism moves the same bytes), 2 more with
             full recomputation; on the critical path;
    cp       per layer and micro-batch, an all-gather of K and V (2 b s h kv_heads / heads values)
             forward and a reduce-scatter of their gradients backward, one more all-gather with
             full recomputation ([Llama3] 3.3.2); on the critical path;
    ep       `expert_parallel_seconds`: 4 all-to-alls per MoE layer and micro-batch; on the
             critical path;
    dp       `data_parallel_seconds`: all of the traffic, and `exposed_dp`, what no computation
             hides (all of it without `overlap_dp`);
    pp       each micro-batch's activation forward and its gradient back, over one link, once
             per model chunk (interleave times).
    mfu      the model's FLOPs (attention's included with `attention`, as [PaLM] Appendix B
             counts them: Chowdhery et al. 2022, https://arxiv.org/abs/2204.02311) over
             total x GPUs x peak.
    The bandwidths are per GPU and direction, for the links each group actually crosses.
    """
    m, world = layout.micro_batches, layout.gpus
    tokens = layout.global_batch * model.seq
    useful = training_flops(active_params(model), tokens)
    work = training_flops(active_params(model), tokens, layout.recompute)
    if attention:
        useful += attention_flops(model.layers, model.hidden, model.seq, tokens)
        work += attention_flops(model.layers, model.hidden, model.seq, tokens, layout.recompute)
    compute = work / (world * hardware.flops * efficiency)
    bubble = 0.0
    if layout.pp > 1:
        bubble = compute * pipeline_bubble(layout.pp, m, layout.interleave, layout.schedule)
    activation = layout.micro_batch * model.seq / layout.cp * model.hidden * precision.activation
    full = layout.recompute == "full"
    tp = 0.0
    if layout.tp > 1:
        per_layer = (6 if full else 4) * allreduce_seconds(activation, layout.tp, tp_bandwidth)
        tp = model.layers / layout.pp * m * per_layer
    cp = 0.0
    if layout.cp > 1:
        if cp_bandwidth is None:
            raise ValueError("cp > 1 needs cp_bandwidth")
        kv = 2 * layout.micro_batch * model.seq * model.hidden * (model.kv_heads or model.heads) / model.heads
        cp = model.layers / layout.pp * m * (3 if full else 2) * allgather_seconds(
            kv * precision.activation / layout.tp, layout.cp, cp_bandwidth)
    if layout.ep > 1 and ep_bandwidth is None:
        raise ValueError("ep > 1 needs ep_bandwidth")
    ep = expert_parallel_seconds(model, layout, ep_bandwidth or 1.0, precision.activation)
    dp, exposed_dp = data_parallel_seconds(model, layout, compute, dp_bandwidth, precision)
    if not overlap_dp:
        exposed_dp = dp
    pp = 2 * m * layout.interleave * activation / pp_bandwidth if layout.pp > 1 else 0.0
    total = compute + bubble + tp + cp + ep + exposed_dp + pp
    return {"compute": compute, "bubble": bubble, "tp": tp, "cp": cp, "ep": ep, "dp": dp,
            "exposed_dp": exposed_dp, "pp": pp, "total": total,
            "mfu": useful / (total * world * hardware.flops)}
