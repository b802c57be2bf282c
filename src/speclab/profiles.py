"""Profiles: validated YAML configs that say what to run and how (profiles/*.yaml).

`load(name_or_path)` parses and validates everything that needs no environment, and `expand`
turns a profile's grid into `Point`s (one engine configuration each); `speclab.preflight`
checks what depends on the machine. Both fail with one clear line per problem before any
model loads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speclab import convention, methods
from speclab.paths import RESOURCES as REPO  # the checkout, or the wheel's copies

PROFILE_DIR = Path(os.environ.get("SPECLAB_PROFILES", REPO / "profiles"))


class ProfileError(ValueError):
    """A profile that cannot run; the message says why, one problem per line."""


class Layout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    ep: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def label(self) -> str:
        return f"tp{self.tp}" + (f"dp{self.dp}" if self.dp > 1 else "") + ("-ep" if self.ep else "")


class Prompts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str
    limit: int | None = Field(None, ge=1)
    categories: list[str] | None = None
    seed: int = 0


class Grid(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # speculative methods (speclab.methods); None: the profile's `method` for every point
    method: list[methods.Method] | None = None
    num_speculative_tokens: list[int] = [0, 1, 2, 3]
    # a method's own k values where they differ from num_speculative_tokens ({mtp: [1, 2, 3]})
    k_by_method: dict[methods.Method, list[int]] = {}
    kv_cache_dtype: list[str] = ["auto"]
    draft_kv_cache_dtype: list[str] = ["auto"]
    layout: list[Layout] = [Layout()]
    prompt_format: list[Literal["raw", "chat"]] = ["raw"]
    # draft aux-layer id convention per point (speclab.convention); None: resolved per draft
    aux_layer_convention: list[convention.Convention] | None = None

    @field_validator("method")
    @classmethod
    def _methods(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError(f"method: give distinct values ({', '.join(methods.METHODS)})")
        return v

    @field_validator("aux_layer_convention")
    @classmethod
    def _conventions(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError("aux_layer_convention: give distinct values (output, input)")
        return v

    @field_validator("num_speculative_tokens", "kv_cache_dtype", "draft_kv_cache_dtype",
                     "layout", "prompt_format")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("empty; give at least one value")
        return v

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k(cls, v: list[int]) -> list[int]:
        if any(k < 0 for k in v):
            raise ValueError(
                "num_speculative_tokens: give k >= 0 values (0 = no-speculation baseline)")
        return sorted(set(v))

    @field_validator("k_by_method")
    @classmethod
    def _k_by_method(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        return {m: cls._k(ks) for m, ks in v.items()}

    def k_values(self, method: str) -> list[int]:
        """The k values the grid runs for `method`."""
        return self.k_by_method.get(method, self.num_speculative_tokens)


class Control(BaseModel):
    """A positive control: one injected defect (speclab.defects) at each size and seed."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["verify-bias", "accept-bias", "aux-layers"]
    sizes: list[float] = []          # nats (biases)
    share: float = Field(1.0, gt=0, le=1)
    seeds: list[int] = [0]
    aux_ids: list[int] | None = None  # aux-layers: the layers fed to the draft instead
    k: int | None = Field(None, ge=1)  # None: parity.spec_k

    @model_validator(mode="after")
    def _sized(self) -> Control:
        if self.kind == "aux-layers" and not self.aux_ids:
            raise ValueError("aux-layers control: give aux_ids")
        if self.kind != "aux-layers" and not self.sizes:
            raise ValueError(f"{self.kind} control: give sizes (nats)")
        return self


class Parity(BaseModel):
    """Parity experiment and its pre-registered analysis (notebook 03_parity; see
    speclab.parity.plan and speclab.parity.Settings): fixed before the run, shown in the
    report; other settings are a named re-analysis beside it."""

    model_config = ConfigDict(extra="forbid")
    arms: list[Literal["spec", "repeat", "noise", "draft-kv", "target-kv", "tp2-ep", "batch1",
                       "batch-invariant", "cuda-graphs"]] = ["spec", "repeat"]
    k_values: list[int] = [1, 2, 3, 4]
    spec_k: int = Field(3, ge=1)
    near_tie: float = Field(0.05, gt=0)
    # plain-repeat arm: passes in separate engines and in one engine
    noise_passes: int = Field(3, ge=3)
    # "max-flip": the largest margin at which two plain passes of the run diverged; a number:
    # a fixed floor in nats
    noise_floor: Literal["max-flip"] | float = "max-flip"
    # expected counters from the CPU reference (JSON, repo-relative) and the largest
    # |measured - expected| acceptance rate that does not flag an arm
    expected: str | None = None
    acceptance_tolerance: float = Field(0.01, ge=0)
    # a defect size counts as detected when at least this share of its runs is flagged
    detect_share: float = Field(1.0, gt=0, le=1)
    controls: list[Control] = []


class Ngram(BaseModel):
    """Prompt lookup (vLLM's ngram method): the longest suffix of prompt + output of
    prompt_lookup_min..prompt_lookup_max tokens that occurred earlier proposes what followed."""

    model_config = ConfigDict(extra="forbid")
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _window(self) -> Ngram:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


class RayOptions(BaseModel):
    """How the Ray executor places points (README "On a Ray cluster")."""

    model_config = ConfigDict(extra="forbid")
    # the cluster ("HOST:PORT", "ray://HOST:10001", "auto"); default: RAY_ADDRESS, else a Ray
    # instance started on this machine for the sweep
    address: str | None = None
    # what one TP x DP rank asks for: GPU for cuda profiles, CPU for cpu ones; another name
    # stands in for GPUs (the CPU tests declare GPUs on GPU-less nodes instead)
    resource: str | None = None
    retries: int = Field(2, ge=0)  # node failures a point survives (each rerun elsewhere)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    backend: Literal["cpu", "cuda"]
    target: str
    draft: str | None = None
    # the speculative method of every point (grid.method sweeps several; speclab.methods);
    # None: eagle3
    method: methods.Method | None = None
    ngram: Ngram = Ngram()
    # Hugging Face revisions (branch, tag or commit) to load; None: what the cache holds
    target_revision: str | None = None
    draft_revision: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str | None = None
    skip_tokenizer_init: bool = False
    prompts: Prompts
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    ignore_eos: bool = True
    warmup: bool = True
    # tokens per warm-up request: 4 covers prefill and the first decode shapes; GPU profiles
    # use max_tokens so every decode batch size of the measured run is JIT-compiled untimed
    warmup_tokens: int = Field(4, ge=1)
    seed: int = 0
    repeats: int = Field(1, ge=1)
    # timed passes per point, in rounds over the points (sweep.run): throughput and speedup
    # get 95% CIs from the spread between rounds
    timed_passes: int = Field(3, ge=1)
    draft_cost: float = Field(0.1, ge=0.0)
    grid: Grid = Grid()
    parity: Parity = Parity()
    compare_formats: list[Literal["raw", "chat"]] = []
    engine: dict[str, Any] = {}
    env: dict[str, str] = {}
    # required: check_env fails unless vLLM supports EAGLE-3 on DeepSeek-V4 natively or the
    # overlay is installed; off: no check (e.g. to reproduce the stock error)
    overlay: Literal["auto", "required", "off"] = "auto"
    # the draft's aux-layer id convention for every point (speclab.convention); None: resolved
    aux_layer_convention: convention.Convention | None = None
    min_vllm: str | None = None
    timeout_s: int = Field(900, ge=10)
    # where points run: "local" (one after another, here) or "ray" (on a Ray cluster)
    executor: Literal["local", "ray"] = "local"
    ray: RayOptions = RayOptions()
    # ray: every grid (speed) point gets a node to itself; points outside the grid (parity
    # arms, prompt-format comparisons) share nodes
    exclusive_node: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        if not self.draft and any(methods.uses_draft(m) and any(self.grid.k_values(m))
                                  for m in methods.profile_methods(self)):
            raise ValueError("grid has k > 0 with method eagle3 but no draft model is set")
        if extra := set(self.grid.k_by_method) - set(methods.profile_methods(self)):
            raise ValueError(f"grid.k_by_method: {', '.join(sorted(extra))} is not among the "
                             f"methods ({', '.join(methods.profile_methods(self))})")
        if self.grid.method is not None and self.method is not None:
            raise ValueError("method is set both at the top level and in grid: keep one "
                             "(grid sweeps it, the top level fixes it for every point)")
        if problem := methods.static_problem(self):
            raise ValueError(problem)
        if any(lay.dp > 1 for lay in self.grid.layout):
            raise ValueError("grid.layout: dp > 1 needs server mode (offline runs take tp and ep)")
        for key in ("model", "speculative_config", "tensor_parallel_size", "kv_cache_dtype",
                    "data_parallel_size", "enable_expert_parallel"):
            if key in self.engine:
                raise ValueError(f"engine.{key} is set by the grid/profile, remove it from engine:")
        if problem := convention.profile_problem(self):
            raise ValueError(problem)
        return self

    @property
    def max_gpus(self) -> int:
        return max(lay.gpus for lay in self.grid.layout)


class Point(BaseModel):
    """One engine configuration to run (a grid point or a parity arm)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    k: int
    # None for the plain (k = 0) baseline, which every method shares (methods.of)
    method: methods.Method | None = "eagle3"
    kv_cache_dtype: str = "auto"
    draft_kv_cache_dtype: str | None = None
    layout: Layout = Layout()
    prompt_format: str = "raw"
    aux_layer_convention: convention.Convention | None = None
    repeat: int = 0
    concurrency: int | None = Field(None, ge=1)
    env: dict[str, str] = {}
    engine: dict = {}

    @property
    def id(self) -> str:
        method = methods.of(self)
        parts = [f"k{self.k}"] + ([method] if method not in (None, "eagle3") else [])
        parts.append(f"kv-{self.kv_cache_dtype}")
        if methods.uses_draft(method):  # eagle3 ids keep their form from before methods
            parts.append(f"dkv-{self.draft_kv_cache_dtype}")
        if self.aux_layer_convention:
            parts.append(f"aux-{self.aux_layer_convention}")
        parts += [self.layout.label, self.prompt_format]
        if self.concurrency is not None:
            parts.append(f"c{self.concurrency}")
        if self.env or self.engine:
            blob = json.dumps([self.env, self.engine], sort_keys=True).encode()
            parts.append("x" + hashlib.sha1(blob).hexdigest()[:8])
        if self.repeat:
            parts.append(f"r{self.repeat}")
        return "_".join(parts)

    @property
    def logprobs(self) -> int:
        """Plain (k=0) runs return top-2 logprobs: the parity analysis reads the target's
        top-1/top-2 margin from them."""
        return 2 if self.k == 0 else 0


def expand(profile: Profile) -> list[Point]:
    """The profile's grid as points, repeats included: k = 0 is one plain point shared by
    every method (no method, draft KV dtype or aux-layer convention); methods without a
    draft ignore the draft KV dtype and convention."""
    g = profile.grid
    conventions = g.aux_layer_convention or [profile.aux_layer_convention]
    seen: dict[str, Point] = {}
    for lay in g.layout:
        for fmt in g.prompt_format:
            for kv in g.kv_cache_dtype:
                for method in methods.profile_methods(profile):
                    for k in g.k_values(method):
                        drafted = k > 0 and methods.uses_draft(method)
                        for dkv, conv in itertools.product(
                                *((g.draft_kv_cache_dtype, conventions) if drafted
                                  else ([None],) * 2)):
                            for r in range(profile.repeats):
                                p = Point(k=k, method=method if k else None, kv_cache_dtype=kv,
                                          draft_kv_cache_dtype=dkv, aux_layer_convention=conv,
                                          layout=lay, prompt_format=fmt, repeat=r)
                                seen.setdefault(p.id, p)
    return list(seen.values())


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    cand = PROFILE_DIR / f"{name_or_path}.yaml"
    if not cand.exists():
        raise ProfileError(f"unknown profile {name_or_path!r}; available: {', '.join(available())}")
    return cand


def load(name_or_path: str | os.PathLike, overrides: dict | None = None) -> Profile:
    """Parse and statically validate a profile (no environment checks)."""
    path = resolve_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ProfileError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a mapping of settings (name: ..., target: "
                           f"...), this file holds a {type(data).__name__}")
    if overrides is not None and not isinstance(overrides, dict):
        raise ProfileError(f"overrides must be a mapping, got a {type(overrides).__name__}")
    data = _merge(data, overrides or {})
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        lines = [f"{_source(err['loc'], overrides, path.name)}: "
                 f"{'.'.join(map(str, err['loc'])) or 'profile'}: "
                 f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors()]
        raise ProfileError("\n".join(lines)) from None


def _source(loc: tuple, overrides: dict | None, file: str) -> str:
    """Where a bad value came from: "overrides" when the overrides set it, else the file."""
    node = overrides
    for key in loc:
        if isinstance(node, dict) and key in node or \
                isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return file
    return "overrides" if loc else file


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --------------------------------------------------------------------- references
def resolve_model(ref: str) -> str:
    """`fixture:NAME` → the built fixture's directory (building it if needed); a path or hub
    id is returned unchanged."""
    if ref.startswith("fixture:"):
        from speclab import fixtures

        return str(fixtures.build(ref.split(":", 1)[1]))
    return ref


def prompt_file(profile: Profile) -> Path:
    p = Path(profile.prompts.file)
    return p if p.is_absolute() else REPO / p
