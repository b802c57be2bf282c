"""`store.RequestRecord`s for tests that write run folders by hand: every required field
filled with a plain value, the given ones over them."""

from speclab import store

DEFAULTS = {"k": 0, "kv_cache_dtype": "auto", "layout": "tp1", "prompt_format": "raw",
            "repeat": 0, "concurrency": 1, "prompt_id": "p0", "category": "c",
            "output_token_ids": [], "n_output": 0, "step_tokens": [], "step_times": [],
            "drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}


def request(point_id: str = "k0_kv-auto_tp1_raw", **fields) -> store.RequestRecord:
    return store.RequestRecord(**{**DEFAULTS, "point_id": point_id, **fields})


def requests(rows: list[dict]) -> list[store.RequestRecord]:
    return [request(**row) for row in rows]
