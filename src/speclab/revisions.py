"""Which revision of the target and the draft a point loads, and whether the draft was trained
against that target revision.

The convention (README "Revisions"): a draft names the target revision it was trained
against as `base_model_revision` (a commit hash, full or short, a branch or a tag) in the
YAML front matter of its README.md, beside Hugging Face's `base_model`; a top-level
`base_model_revision` in its config.json counts the same. A target's revision is the commit
of the Hugging Face cache snapshot that `target_revision` (default: main) resolves to, else
the pin itself; a local folder or fixture has none (the fingerprint's config hash and weight
sizes say which files it is). Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

KEY = "base_model_revision"


def _snapshot(ref: str, revision: str | None) -> Path | None:
    """The cache snapshot folder `revision` (default main) of hub id `ref` resolves to."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        hit = try_to_load_from_cache(ref, "config.json", revision=revision)
    except ValueError:  # not a hub id
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def _folder(ref: str, revision: str | None) -> Path | None:
    """Where a model's files are on this machine (a folder, a built fixture, a cache
    snapshot), without building or downloading anything."""
    if ref.startswith("fixture:"):
        name = ref.split(":", 1)[1]
        try:
            from speclab import fixtures

            return fixtures.fixture_dir(name) if name in fixtures.FIXTURES else None
        except ImportError:
            return None
    if Path(ref).expanduser().is_dir():
        return Path(ref).expanduser()
    return _snapshot(ref, revision) if ref.count("/") == 1 else None


def loaded(ref: str | None, revision: str | None) -> str | None:
    """The revision a hub model loads: its cached snapshot's commit, else the pin; None for
    a local folder or fixture."""
    if not ref or ref.startswith("fixture:") or Path(ref).expanduser().exists():
        return None
    snap = _snapshot(ref, revision)
    return snap.name if snap is not None else revision


def trained_against(ref: str | None, revision: str | None = None) -> str | None:
    """The target revision a draft names (`base_model_revision` in its README.md front
    matter or config.json), when its files are on this machine."""
    folder = _folder(ref, revision) if ref else None
    if folder is None:
        return None
    readme = folder / "README.md"
    if readme.is_file():
        text = readme.read_text(errors="replace")
        if text.startswith("---"):
            front = text.split("---", 2)[1] if text.count("---") >= 2 else ""
            try:
                meta = yaml.safe_load(front) or {}
            except yaml.YAMLError:
                meta = {}
            if isinstance(meta, dict) and meta.get(KEY):
                return str(meta[KEY])
    cfg = folder / "config.json"
    if cfg.is_file():
        try:
            value = json.loads(cfg.read_text()).get(KEY)
        except (ValueError, AttributeError):
            value = None
        if value:
            return str(value)
    return None


def same(a: str, b: str) -> bool:
    """Whether two revisions name the same commit: equal, or one commit hash (at least 7
    hex digits) a prefix of the other."""
    a, b = a.strip().lower(), b.strip().lower()
    if a == b:
        return True
    short, long = sorted((a, b), key=len)
    hexdigits = set("0123456789abcdef")
    return len(short) >= 7 and set(a) | set(b) <= hexdigits and long.startswith(short)


def mismatch(profile) -> str | None:
    """One line when a draft the profile loads was trained against another target revision
    than the one loaded; None when they agree or either is unknown."""
    from speclab import methods

    if not any(methods.uses_draft(m) for m in methods.profile_methods(profile)):
        return None
    wanted = trained_against(profile.draft, profile.draft_revision)
    have = loaded(profile.target, profile.target_revision)
    if wanted is None or have is None or same(wanted, have):
        return None
    return (f"Revision: the draft {profile.draft} names target revision {wanted} "
            f"({KEY}), the target {profile.target} loads {have}: its acceptance is measured "
            "against weights it was not trained on.")


def record(profile, point) -> dict:
    """Point metadata: each model the point loads, the revision asked for and the one
    loaded (None: a local folder or fixture)."""
    from speclab import methods

    out = {"target": {"ref": profile.target, "revision": profile.target_revision,
                      "loaded": loaded(profile.target, profile.target_revision)}}
    if methods.uses_draft(methods.of(point)):
        out["draft"] = {"ref": profile.draft, "revision": profile.draft_revision,
                        "loaded": loaded(profile.draft, profile.draft_revision),
                        "trained_against": trained_against(profile.draft,
                                                           profile.draft_revision)}
    return out
