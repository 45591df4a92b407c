"""Back-of-the-envelope models of a parallel training step: memory per GPU and seconds per step.

Lesson 16 plans data x tensor x pipeline parallel runs with them and checks the memory model
against CPU processes. Each function states its formula and where it comes from; they are the
published approximations, not a simulator (no latency, no kernel launch, no fragmentation).
Sources, cited below by key:

[ZeRO]        S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
              Models", SC 2020, https://arxiv.org/abs/1910.02054: section 3.1 (mixed-precision Adam
              keeps 2 + 2 + K bytes per parameter, K = 12), section 5 and Figure 1 (the three
              stages), section 7 (their communication volume).
[Korthikanti] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
              Models", MLSys 2023, https://arxiv.org/abs/2205.05198: section 4 and Table 2
              (activation bytes per layer; tensor and sequence parallelism; the first pipeline stage
              holds p micro-batches, 4.2.3), section 5 (selective recomputation).
[Narayanan]   D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
              Using Megatron-LM", SC 2021, https://arxiv.org/abs/2104.04473: section 2.2 (the
              pipeline bubble, 1F1B and interleaving), section 3 (tensor parallelism's all-reduces).
[Kaplan]      J. Kaplan et al., "Scaling Laws for Neural Language Models", 2020,
              https://arxiv.org/abs/2001.08361: section 2.1 (training costs about 6N FLOPs a token).
[Playbook]    N. Tazi et al., "The Ultra-Scale Playbook", Hugging Face, 2025,
              https://huggingface.co/spaces/nanotron/ultrascale-playbook (the same formulas, and
              parameters spread evenly over tp x pp).
[NCCL]        NCCL tests, doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests: a ring
              all-reduce moves 2(n-1)/n of the buffer through each rank's link, all-gather and
              reduce-scatter (n-1)/n.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")
RECOMPUTE = ("none", "selective", "full")


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
    """A decoder-only transformer: parameters, layers, hidden size, attention heads, sequence length."""
    n_params: float
    layers: int
    hidden: int
    heads: int
    seq: int


@dataclass(frozen=True)
class Layout:
    """How a step is spread: parallel degrees, ZeRO stage, batch in sequences, schedule, recomputation."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1       # sequences per micro-batch
    global_batch: int = 1      # sequences per optimizer step, all dp ranks together
    schedule: str = "1f1b"
    interleave: int = 1        # model chunks (virtual stages) per pipeline rank [Narayanan] 2.2.2
    sp: bool = False           # sequence parallelism with tp [Korthikanti]
    recompute: str = "none"    # "none", "selective" (attention core) or "full" (whole layers)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per dp rank and step: global_batch / (dp * micro_batch), a whole number."""
        per_rank, rest = divmod(self.global_batch, self.dp * self.micro_batch)
        if rest or not per_rank:
            raise ValueError(f"global_batch {self.global_batch} is not a multiple of dp x micro_batch "
                             f"= {self.dp * self.micro_batch}")
        return per_rank


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    """Parameters of a Llama-style model: grouped-query attention (q and o: h x h; k and v:
    h x kv_heads * h / heads), a SwiGLU MLP (three h x ffn matrices), two RMSNorm weights per
    layer, a final norm, and untied input and output embeddings (V x h each); no biases."""
    kv = kv_heads * hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + hidden + 2 * vocab * hidden


def model_state_memory(model: Model, layout: Layout, precision: Precision = MIXED) -> dict:
    """Bytes of weights, gradients and optimizer state on one GPU of `layout`, by component
    (floats: an average over the GPUs, not a count of any one rank's elements).

    The model's parameters are spread evenly over tp x pp ([Playbook], embeddings included),
    Psi = model.n_params / (tp x pp) per GPU, then ZeRO shards over the Nd = dp ranks
    ([ZeRO] Figure 1, K optimizer bytes per parameter): stage 0 (plain data parallel)
    (2 + 2 + K) Psi; stage 1 shards the optimizer state, 2 Psi + 2 Psi + K Psi / Nd; stage 2
    the gradients too, 2 Psi + (2 + K) Psi / Nd; stage 3 the weights too, (2 + 2 + K) Psi / Nd.
    `precision` replaces the 2, 2 and K.
    """
    zero, dp = layout.zero, layout.dp
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, not {zero}")
    psi = model.n_params / (layout.tp * layout.pp)
    return {"params": psi * precision.param / (dp if zero >= 3 else 1),
            "grads": psi * precision.grad / (dp if zero >= 2 else 1),
            "optimizer": psi * precision.optimizer / (dp if zero >= 1 else 1)}


def activation_bytes(seq: int, batch: int, hidden: int, heads: int, layers: float = 1, *, tp: int = 1,
                     sp: bool = False, recompute: str = "none", bytes_per_value: float = 2) -> float:
    """Bytes a forward keeps for backward in `layers` transformer layers, for `batch` sequences.

    [Korthikanti] section 4 and Table 2, per layer, s = seq, b = batch, h = hidden, a = heads,
    t = tp, in bytes with 2-byte activations and 1-byte dropout masks:
      no parallelism            s b h (34 + 5 a s / h)
      tensor parallel           s b h (10 + 24 / t + 5 a s / (h t))
      tensor + sequence par.    s b h (34 + 5 a s / h) / t
      selective recomputation   the 5 a s / h term (attention's s x s matrices) is recomputed
      full recomputation        2 s b h (only each layer's input is kept)
    The 34 counts 16 values per token and hidden unit (2 bytes each) and two dropout masks; the
    5 a s / h counts the softmax's output and its dropout (2 bytes each) and that dropout's mask.
    `bytes_per_value` / 2 scales everything (masks included: an approximation for other dtypes).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}")
    sbh = seq * batch * hidden
    attention = 0 if recompute == "selective" else 5 * heads * seq / hidden
    if recompute == "full":
        per_layer = 2 * sbh
    elif sp or tp == 1:
        per_layer = sbh * (34 + attention) / tp
    else:
        per_layer = sbh * (10 + 24 / tp + attention / tp)
    return layers * per_layer * bytes_per_value / 2


def first_stage_in_flight(pp: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B starts backward once the pipeline
    is full: the first stage holds p, or m if there are fewer ([Narayanan] 2.2.1,
    [Korthikanti] 4.2.3: with L / p layers and p micro-batches the first stage holds L layers'
    worth)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}")
    return micro_batches if schedule == "gpipe" else min(pp, micro_batches)


def estimate_memory(model: Model, layout: Layout, precision: Precision = MIXED) -> dict:
    """Bytes per GPU of the first pipeline stage (the fullest under 1F1B): model states
    (`model_state_memory`: n_params / (tp x pp) parameters sharded by ZeRO over dp), plus the
    activations of L / pp layers times the micro-batches in flight; an interleaved schedule
    keeps 1 + (p - 1) / (p m) times more ([Korthikanti] 4.2.3)."""
    states = model_state_memory(model, layout, precision)
    m = layout.micro_batches
    in_flight = first_stage_in_flight(layout.pp, m, layout.schedule)
    if layout.interleave > 1:
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * m)
    states["activations"] = in_flight * activation_bytes(
        model.seq, layout.micro_batch, model.hidden, model.heads, model.layers / layout.pp, tp=layout.tp,
        sp=layout.sp, recompute=layout.recompute, bytes_per_value=precision.activation)
    states["total"] = sum(states.values())
    return states


def training_flops(n_params: float, tokens: float, recompute: str = "none") -> float:
    """FLOPs of forward and backward: 2N per token forward, 4N backward, 6N in all ([Kaplan] 2.1;
    leaves out attention's s-dependent term, about 2 L s h per token forward). Full
    recomputation runs the forward twice: 8N ([Korthikanti] section 5)."""
    return (8 if recompute == "full" else 6) * n_params * tokens


def allreduce_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: each rank's link carries 2 (n-1)/n nbytes
    ([NCCL], "bus bandwidth"); at `bandwidth` bytes/s, no latency term."""
    return 2 * (n - 1) / n * nbytes / bandwidth


def allgather_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` whole: (n-1)/n nbytes per link ([NCCL])."""
    return (n - 1) / n * nbytes / bandwidth


def pipeline_bubble(pp: int, micro_batches: int, interleave: int = 1) -> float:
    """Idle time of a pipeline flush relative to the ideal compute time: (p - 1) / m for GPipe and
    1F1B, (p - 1) / (v m) with v interleaved stages per rank ([Narayanan] 2.2.1 and 2.2.2)."""
    return (pp - 1) / (interleave * micro_batches)


def estimate_step(model: Model, layout: Layout, hardware: Hardware, *, tp_bandwidth: float,
                  dp_bandwidth: float, pp_bandwidth: float, efficiency: float = 0.5,
                  precision: Precision = MIXED, overlap_dp: bool = True) -> dict:
    """Seconds of one optimizer step on every GPU, by part, and the model FLOPs utilization.

    compute  training_flops / (GPUs x peak x efficiency): `efficiency` is the fraction of peak
             the kernels reach, an assumption to state;
    bubble   compute x pipeline_bubble(pp, m, interleave);
    tp       per layer and micro-batch, 2 all-reduces forward and 2 backward of the (b, s, h)
             activation ([Narayanan] 3; sequence parallelism moves the same bytes), 2 more with
             full recomputation; on the critical path;
    dp       gradients of n_params / (tp x pp) parameters: an all-reduce's bytes for ZeRO 0-2,
             1.5 times that for ZeRO-3 (the weights gathered again in backward) ([ZeRO] 7);
             with `overlap_dp` only what exceeds the backward (2/3 of compute) counts;
    pp       each micro-batch's activation forward and its gradient back, over one link, once
             per model chunk (interleave times).
    The bandwidths are per GPU and direction, for the links each group actually crosses.
    """
    m, world = layout.micro_batches, layout.gpus
    compute = training_flops(model.n_params, layout.global_batch * model.seq, layout.recompute) / (
        world * hardware.flops * efficiency)
    bubble = compute * pipeline_bubble(layout.pp, m, layout.interleave) if layout.pp > 1 else 0.0
    activation = layout.micro_batch * model.seq * model.hidden * precision.activation
    per_layer = 6 if layout.recompute == "full" else 4
    tp = 0.0
    if layout.tp > 1:
        tp = model.layers / layout.pp * m * per_layer * allreduce_seconds(activation, layout.tp, tp_bandwidth)
    dp = 0.0
    if layout.dp > 1:
        gradients = model.n_params / (layout.tp * layout.pp) * precision.grad
        dp = (1.5 if layout.zero == 3 else 1.0) * allreduce_seconds(gradients, layout.dp, dp_bandwidth)
    exposed_dp = max(0.0, dp - 2 / 3 * compute) if overlap_dp else dp
    pp = 2 * m * layout.interleave * activation / pp_bandwidth if layout.pp > 1 else 0.0
    total = compute + bubble + tp + exposed_dp + pp
    useful = training_flops(model.n_params, layout.global_batch * model.seq)
    return {"compute": compute, "bubble": bubble, "tp": tp, "dp": dp, "exposed_dp": exposed_dp, "pp": pp,
            "total": total, "mfu": useful / (total * world * hardware.flops)}
