"""The vLLM releases the overlay's matrix was read from (`speclab.vllm_matrix` reads them,
`speclab.overlay` warns past the newest): a leaf module, so that both can import it."""

from __future__ import annotations

import re

RELEASES = ("0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0",
            "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
            "0.34.0")
"""Every release the committed matrix was read from; the newest is the overlay's horizon."""
FIRST = "0.21.0"  # the oldest release the overlay supports


def vkey(version: str) -> tuple[int, ...]:
    """A release's sort key: its first three numbers."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def horizon(version: str | None) -> str | None:
    """A warning when ``version`` is newer than the newest release the matrix was read
    from (the overlay's plan for it rests on facts nobody has reviewed), else None."""
    if version is None or vkey(version) <= vkey(RELEASES[-1]):
        return None
    return (f"vLLM {version} is newer than {RELEASES[-1]}, the newest release in the overlay's "
            f"matrix: not read by this overlay version: run tools/vllm_matrix.py {version}")
