#!/usr/bin/env python3
"""Same as `ms-llm prepare-data`; runs from a fresh clone without installing."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.commands import prepare_data, tool_main  # noqa: E402  (the path above must come first)

if __name__ == "__main__":
    raise SystemExit(tool_main(prepare_data, Path(__file__).name))
