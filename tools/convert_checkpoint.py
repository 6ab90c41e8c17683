"""Convert checkpoints: ms_llm <-> Hugging Face / MindSpore / torch DCP, and reshard.

    python tools/convert_checkpoint.py SRC DST --to hf
    python tools/convert_checkpoint.py HF_DIR DST --from hf
    python tools/convert_checkpoint.py SRC DST --to mindspore --strategy tp2 --world-size 4
    python tools/convert_checkpoint.py SRC DST --strategy dp2 --world-size 2      # reshard

The same as `ms-llm convert-checkpoint ...`; see `--help` for every option.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert-checkpoint", *sys.argv[1:]]))
