"""What a TP G + expert-parallel node changes to the one-GPU step: a bracket computed from
the measured one-GPU steps and stated assumptions, not a measurement.

What vLLM runs (0.34.0 `vllm/models/deepseek_v4/nvidia/model.py`, TP G, DP 1,
`enable_expert_parallel`): each rank holds 256 / G routed experts (`n_local_physical_experts`)
and sees every token; attention and the shared expert are split over the ranks and the layer
ends in two collectives of n x hidden bf16 (attention's `wo_b` and the MoE output all-reduced;
with a mega-MoE backend, sequence parallelism's all-gather and reduce-scatter instead,
`_use_sequence_parallel`), plus the target's logits gather a step. The EAGLE-3 draft runs at
the target's TP: three collectives a draft forward (attention, MLP, logits).

The one-GPU step at L layers, T_1(n) (`layerfit.extrapolate`'s plain curve), splits into the
routed experts' part L beta E(n), where beta is one expert read per layer (the fit of the
measured per-layer slope b(n) = alpha + beta E(n), `expert_fit`), and the rest
R(n) = T_1(n) - L beta E(n). On the node:

    T_G(n)          = R(n) - (1 - 1/G) V + L beta M_G(n) + (2 L + 1) t_ar(n hidden 2 B)
    T_draft,G(k, B) = T_draft(k, B) - (1 - 1/G) V_draft + 3 k t_ar(B hidden 2 B)
                      (MTP: its k forwards' routed experts, k beta E(B), read as k beta M_G(B))
    T_sample,G      = T_sample (the sampler runs on every rank, whole)

M_G(n) is the expected largest number of distinct routed experts one rank reads when n tokens
pick 6 of 256 evenly (the step waits for the slowest rank; `max_rank_experts`). V, the part of
the rest that TP divides, and t_ar, one collective, were not measured; the bracket's corners:

* `tp`: `latency` (V = 0: the rest is launches and latencies TP does not shorten), `weights`
  (V = the time to read the weights TP splits besides the routed experts: per layer the shared
  expert, `wq_b`, `wo_a`, `wo_b`, per step the head; for the drafter its sharded weights
  (EAGLE-3: the draft's; MTP: its block's besides the routed experts, and the head) k times;
  at the rate beta reads experts, `divided_ms`), `all` (V = R: TP divides the rest);
* `allreduce`: `none` (free: the floor), `lo` and `hi`, two published small-message
  all-reduce curves at G GPUs (`AR_US`: G = 2, 4, 8).

With G = 1 the model is `predict.predict`'s. Not covered: imbalance from a trained router,
EPLB, DP attention and all-to-all (DP > 1), GPUs other than the one measured.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pandas as pd

from speclab import cudagraphs, predict
from speclab.fixtures import dsv4_shapes as SH

HIDDEN = 4096  # DeepSeek-V4-Flash's hidden_size
BF16 = 2
# HBM bandwidth of the HBM GPUs of `memory.GPUS` (NVIDIA's datasheets; H100: the SXM part): the
# ceiling a fitted per-expert read time is checked against.
HBM_TB_S = {"H200": 4.8, "H100": 3.35, "B200": 8.0}


def hbm_tb_s(gpu: str | None) -> tuple[str, float]:
    """(whose HBM, TB/s) for the GPU nvidia-smi names (`memory.gpu_named`), e.g. ("the
    H100's HBM", 3.35); for an unknown GPU the fastest HBM listed (a ceiling every listed
    GPU stays under), said so."""
    from speclab import memory

    model = memory.gpu_named(gpu or "")
    if model in HBM_TB_S:
        return f"the {model}'s HBM", HBM_TB_S[model]
    model = max(HBM_TB_S, key=HBM_TB_S.get)
    return f"GPU unknown; the fastest HBM listed, the {model}'s", HBM_TB_S[model]


# One all-reduce on 2, 4 and 8 H100s over NVLink, CUDA graphs off: SGLang PR #2904's table
# (sgl-project/sglang, "optimize custom allreduce kernel"), microseconds at "data size" 512 ...
# 1048576, a unit the table does not state. lo: SGLang's kernel with the size read as bf16
# elements; hi: vLLM's custom all-reduce with the size read as bytes.
AR_SIZES = (512, 4096, 32768, 262144, 524288, 1048576)
AR_US = {
    2: {"lo": (3.7, 3.9, 4.5, 7.9, 12.5, 19.9), "hi": (9.5, 8.8, 8.7, 12.9, 17.7, 26.6)},
    4: {"lo": (4.8, 3.7, 4.8, 13.9, 20.2, 31.1), "hi": (9.1, 8.5, 9.2, 20.6, 26.9, 40.2)},
    8: {"lo": (5.9, 5.7, 7.8, 16.7, 22.1, 33.8), "hi": (10.1, 9.3, 11.8, 24.1, 30.4, 45.0)},
}
AR_BYTES_PER_SIZE = {"lo": BF16, "hi": 1}


def allreduce_us(nbytes: float, corner: str, gpus: int = 8) -> float:
    """One collective of `nbytes` over `gpus` GPUs at the `corner` curve of `AR_US` (`none`:
    0; one GPU: 0): linear in log size between the table's points, linear in bytes past the
    last, the first below it; a larger message never costs less (the table's dips below
    32 K, its noise, are levelled up). ValueError for a GPU count the table lacks."""
    if corner == "none" or gpus == 1:
        return 0.0
    if gpus not in AR_US:
        raise ValueError(f"no published all-reduce curve for {gpus} GPUs (have "
                         f"{sorted(AR_US)})")
    x = np.array(AR_SIZES, float) * AR_BYTES_PER_SIZE[corner]
    y = np.maximum.accumulate(np.array(AR_US[gpus][corner], float))
    if nbytes >= x[-1]:
        return float(y[-1] + (nbytes - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))
    return float(np.interp(np.log(max(nbytes, x[0])), np.log(x), y))


def max_rank_experts(n: int, gpus: int, experts: int = predict.MOE[0],
                     top_k: int = predict.MOE[1], draws: int = 2000, seed: int = 0) -> float:
    """Expected largest count of distinct routed experts one of `gpus` ranks reads when `n`
    tokens each pick `top_k` of `experts` evenly and rank r holds the r-th block of experts
    (for one rank: `predict.experts_touched`, exactly)."""
    if experts % gpus:
        raise ValueError(f"{experts} experts do not divide over {gpus} GPUs")
    if gpus == 1:
        return float(predict.experts_touched(n, experts, top_k))
    return _max_rank_experts(int(n), gpus, experts, top_k, draws, seed)


@functools.cache
def _max_rank_experts(n: int, gpus: int, experts: int, top_k: int, draws: int,
                      seed: int) -> float:
    rng = np.random.default_rng(seed)
    maxima = []
    for chunk in np.array_split(np.arange(draws), max(1, draws * n // 20000)):
        keys = rng.random((len(chunk), n, experts), dtype=np.float32)
        picks = np.argpartition(keys, top_k, axis=2)[:, :, :top_k].reshape(len(chunk), -1)
        hit = np.zeros((len(chunk), experts), bool)
        np.put_along_axis(hit, picks, True, axis=1)
        maxima.append(hit.reshape(len(chunk), gpus, experts // gpus).sum(axis=2).max(axis=1))
    return float(np.concatenate(maxima).mean())


def expert_fit(fit: pd.DataFrame, moe=predict.MOE) -> dict:
    """alpha + beta E(n) through the per-layer slopes b(n) of the batch sizes whose growth
    with depth resolved (`layerfit.extrapolate`'s fit): beta is one routed expert read per
    layer, in ms. ValueError with fewer than two such batch sizes, or where the slope's growth
    over them is within the fit's residual."""
    f = fit[fit.resolved]
    if len(f) < 2:
        raise ValueError("the per-expert cost needs the per-layer slope at two or more batch "
                         f"sizes; resolved: {f.n.tolist()}")
    e = predict.experts_touched(f.n.to_numpy(float), *moe)
    beta, alpha = np.polyfit(e, f.b_ms_per_layer.to_numpy(float), 1)
    resid = f.b_ms_per_layer.to_numpy(float) - (alpha + beta * e)
    if beta * (e.max() - e.min()) <= np.abs(resid).max() + 1e-12:
        raise ValueError("the per-layer step does not grow with the experts read beyond the "
                         f"fit's residual (beta {beta * 1e3:.3g} us): no routed experts' part "
                         "to split off")
    return {"alpha_ms": float(alpha), "beta_ms": float(beta),
            "max_resid_ms": float(np.abs(resid).max()), "batch_sizes": f.n.tolist()}


@functools.cache
def expert_bytes(dtype: str = "fp4") -> float:
    """One routed expert of DeepSeek-V4-Flash with `dtype` experts (`memory.routed_expert_bytes`:
    MXFP4 0.5 B a weight + an e8m0 scale per 32, or block-FP8 with its scales)."""
    from speclab import memory

    return memory.routed_expert_bytes(SH.realshape_config(1, dtype))


def divided_ms(beta: float, layers: int, k: int = 0, dtype: str = "fp4",
               method: str = "eagle3") -> tuple[float, float]:
    """(target, draft) ms a one-GPU step spends reading the weights TP splits besides the
    routed experts (`speclab.memory`'s sharded part): DeepSeek-V4-Flash's layers and head,
    and k forwards of the drafter (`eagle3`: the EAGLE3.1 draft; `mtp`: the MTP block's
    shared expert and attention projections and the head), at the rate `beta` reads one
    `dtype` expert."""
    target, drafts = _divided_bytes(layers, dtype)
    per_ms = expert_bytes(dtype) / beta
    return target / per_ms, k * drafts[method] / per_ms


@functools.cache
def _divided_bytes(layers: int, dtype: str) -> tuple[float, dict[str, float]]:
    from speclab import memory

    routed = predict.MOE[0] * expert_bytes(dtype)
    layer = (memory.weight_bytes(SH.realshape_config(5, dtype))[0]
             - memory.weight_bytes(SH.realshape_config(4, dtype))[0] - routed)
    cfg = SH.realshape_config(layers, dtype)
    head = cfg["vocab_size"] * cfg["hidden_size"] * BF16
    # the MTP block reads the target's head, which it shares (`memory.mtp_weight_bytes`)
    mtp = memory.mtp_weight_bytes(SH.realshape_config(layers, dtype, mtp=True))[0] + head
    eagle3 = memory.weight_bytes(SH.realshape_draft_config(cfg))[0]
    return layers * layer + head, {"eagle3": eagle3, "mtp": mtp - routed}


def node_draft(t_draft: float, k: int, B: int, beta: float, gpus: int, tp: str, corner: str,
               method: str, layers: int, moe=predict.MOE, dtype: str = "fp4") -> float:
    """T_draft,G in ms (module doc) from the one-GPU drafter time `t_draft` of k forwards at
    batch B. An MTP forward is a MoE layer: its routed experts' part, beta E(B), becomes the
    busiest rank's, beta M_G(B), as the target's does; the EAGLE-3 drafter has none."""
    mtp = method == "mtp"
    rest = t_draft - (k * beta * predict.experts_touched(B, *moe) if mtp else 0.0)
    div = {"latency": 0.0, "all": rest,
           "weights": min(rest, divided_ms(beta, layers, k, dtype, method)[1])}[tp]
    node_experts = k * beta * max_rank_experts(B, gpus, *moe) if mtp else 0.0
    return (rest - (1 - 1 / gpus) * div + node_experts
            + 3 * k * allreduce_us(B * HIDDEN * BF16, corner, gpus) / 1e3)


def node_step(t1: float, n: float, layers: int, beta: float, gpus: int, tp: str,
              corner: str, moe=predict.MOE, dtype: str = "fp4") -> float:
    """T_G(n) in ms (module doc) from the one-GPU step `t1` = T_1(n) at the `tp` and
    `corner` corners."""
    experts = layers * beta
    rest = t1 - experts * predict.experts_touched(n, *moe)
    div = {"latency": 0.0, "weights": divided_ms(beta, layers, 0, dtype)[0], "all": rest}[tp]
    comm = (2 * layers + 1) * allreduce_us(n * HIDDEN * BF16, corner, gpus) / 1e3
    return rest - (1 - 1 / gpus) * div + experts * max_rank_experts(round(n), gpus, *moe) + comm


TP_CORNERS = ("latency", "weights", "all")
AR_CORNERS = ("none", "lo", "hi")


def bracket(ex: dict, rates, gpus: int = 8, ks=range(1, 6), moe=predict.MOE,
            dtype: str = "fp4") -> pd.DataFrame:
    """Per (draft setting, B, k, tp, allreduce corner) on a TP `gpus` + EP node: T_G at B and
    at the verify step's rows (`cudagraphs.step_rows`: its CUDA graph's), the drafter
    (`node_draft`), tok/s and speedup (module doc), from `layerfit.extrapolate`'s result `ex`
    (its plain curve, drafter times and fit); `best` marks the best k per (draft, B, tp,
    allreduce)."""
    layers = int(ex["plain"].layers.iloc[0])
    beta = expert_fit(ex["fit"], moe)["beta_ms"]
    curve = ex["plain"].set_index("B").step_ms.sort_index()
    eager = bool(ex["plain"].eager.iloc[0])
    by_rows = predict.rows_curve(ex["plain"], layers, eager)
    drafts = ex["drafts"]
    rows = []
    for draft, B, tp, corner in itertools.product(
            sorted(drafts.draft.unique()) or [""], sorted(ex["prediction"].B.unique()),
            TP_CORNERS, AR_CORNERS):
        t0 = node_step(predict.plain_at(curve, B, moe), B, layers, beta, gpus, tp, corner,
                       moe, dtype)
        d = drafts[(drafts.draft == draft) & (drafts.B == B)]
        for k in ks:
            n = cudagraphs.step_rows(B, k, eager, vllm="0.34")  # the release it describes
            verify = node_step(predict.plain_at(by_rows, n, moe), n, layers, beta, gpus, tp,
                               corner, moe, dtype)
            draft_ms = node_draft(predict.drafter_at(d, k, "draft_ms"), k, B, beta, gpus, tp,
                                  corner, predict.method_of(draft), layers, moe, dtype)
            step = verify + draft_ms + predict.sample_extra_at(d, k)  # every rank samples
            al = predict.acceptance_length(predict.rates_for(rates, draft), k)
            rows.append({"gpus": gpus, "draft": draft, "B": B, "k": k, "tp": tp,
                         "allreduce": corner, "al": al, "plain_ms": t0, "verify_ms": verify,
                         "draft_ms": draft_ms, "pred_tok_s": 1e3 * B * al / step,
                         "pred_speedup": al * t0 / step})
    out = pd.DataFrame(rows)
    if len(out):
        best = out.groupby(["draft", "B", "tp", "allreduce"]).pred_speedup.transform("max")
        out["best"] = out.pred_speedup == best
    return out


def summary(corners: pd.DataFrame, one_gpu: pd.DataFrame) -> pd.DataFrame:
    """Per (draft, B, k): the one-GPU prediction (`layerfit.extrapolate`'s) beside the node's
    lowest and highest speedup over every corner, the `weights` band (TP splitting weight
    reads, collectives on the lo to hi curves), and in how many corners that k is best."""
    rows = []
    for (draft, B, k), g in corners.groupby(["draft", "B", "k"]):
        one = one_gpu[(one_gpu.draft == draft) & (one_gpu.B == B) & (one_gpu.k == k)]
        w = g[(g.tp == "weights") & (g.allreduce != "none")].pred_speedup
        rows.append({"draft": draft, "B": B, "k": k,
                     "one_gpu": one.pred_speedup.iloc[0] if len(one) else np.nan,
                     "node_lo": g.pred_speedup.min(), "weights_lo": w.min(),
                     "weights_hi": w.max(), "node_hi": g.pred_speedup.max(),
                     "best_in": int(g.best.sum()), "corners": len(g)})
    return pd.DataFrame(rows)
