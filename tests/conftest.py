import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def fixture_cache(tmp_path_factory) -> Path:
    """Fixture cache shared by the whole session: $SPECLAB_CACHE/fixtures, else a temp dir."""
    root = os.environ.get("SPECLAB_CACHE")
    return Path(root) / "fixtures" if root else tmp_path_factory.mktemp("fixtures")
