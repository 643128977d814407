"""A benchmark's result as JSON: printed, and written to the file ``--json`` names."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, path: Path | None) -> None:
    """Print ``result`` as JSON, and write it to ``path`` (its folder made) when one is given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
