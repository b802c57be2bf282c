"""Offline prompt sets (data/prompts/*.jsonl): loading, sampling, raw vs chat formatting.

One JSON object per line: `id`, `category`, and either `prompt` (a string), `messages`
(chat turns: [{"role", "content"}]) or `prompt_token_ids` (for tokenizer-less fixtures).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str | None = None
    messages: tuple = ()
    prompt_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def turns(self) -> list[dict]:
        """Chat turns (a lone `prompt` becomes one user turn)."""
        if self.messages:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def raw_text(self) -> str:
        """Raw-string form: the prompt, or the user turns joined (no template)."""
        if self.prompt is not None:
            return self.prompt
        return "\n\n".join(m["content"] for m in self.messages if m["role"] == "user")


def load(path: str | Path, *, limit: int | None = None, categories: list[str] | None = None,
         seed: int = 0) -> list[Prompt]:
    """Read a prompt set; filter by category; sample `limit` prompts by seed (stable order)."""
    path = Path(path)
    out = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                             f"{e.start + 1})") from None
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            p = Prompt(
                id=str(d["id"]),
                category=str(d.get("category", "default")),
                prompt=d.get("prompt"),
                messages=tuple(d.get("messages", [])),
                prompt_token_ids=tuple(d.get("prompt_token_ids", [])),
                extra={k: v for k, v in d.items()
                       if k not in ("id", "category", "prompt", "messages", "prompt_token_ids")},
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: bad prompt record: {e}") from None
        if p.prompt is None and not p.messages and not p.prompt_token_ids:
            raise ValueError(f"{path}:{n}: needs prompt, messages or prompt_token_ids")
        out.append(p)
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate prompt ids")
    if categories:
        unknown = set(categories) - {p.category for p in out}
        if unknown:
            raise ValueError(f"{path}: no prompts in categories {sorted(unknown)}")
        out = [p for p in out if p.category in categories]
    if limit is not None and limit < len(out):
        keep = set(random.Random(seed).sample(range(len(out)), limit))
        out = [p for i, p in enumerate(out) if i in keep]
    return out


def to_token_ids(prompts: list[Prompt], tokenizer, fmt: Literal["raw", "chat"]) -> list[list[int]]:
    """Token ids for each prompt: raw text, or the tokenizer's own chat template with a
    generation prompt. Prompts given as token ids pass through (raw only)."""
    out = []
    for p in prompts:
        if p.prompt_token_ids:
            if fmt != "raw":
                raise ValueError(f"prompt {p.id}: token-id prompts have no chat form")
            out.append(list(p.prompt_token_ids))
        elif fmt == "chat":
            ids = tokenizer.apply_chat_template(p.turns(), add_generation_prompt=True,
                                                tokenize=True)
            # transformers 5 returns a BatchEncoding (a Mapping, not a dict) by default
            out.append(list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
        else:
            out.append(list(tokenizer.encode(p.raw_text())))
    return out
