import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    return tmp_path
