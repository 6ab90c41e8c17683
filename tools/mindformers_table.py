#!/usr/bin/env python3
"""Conversion table of MindFormers' shipped pretraining configs: for each YAML under a configs
folder (default: .oracles/configs, the mindformers 2.1.0 wheel's), whether `ms-llm convert-strategy`
reads it, and the keys it warns about (what the IR cannot express, or what ms_llm does not model).

    python tools/mindformers_table.py [CONFIGS_DIR] > table.md
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.job import load_section  # noqa: E402  (the path above must come first)
from ms_llm.convert import ReadOptions, load  # noqa: E402
from ms_llm.errors import MsLlmError  # noqa: E402

# What a user passes on the command line for the files that need it: the pynative layout's
# data_parallel_shard = -1 needs the device count (the file names say 8p; the DeepSeek-V4 ones use
# ep 8 over 8 devices); the general templates keep the shape in a Hugging Face folder.
WORLD_SIZE_8 = ("pretrain_deepseek3_1b_8p_pynative", "pretrain_deepseek4_")
UNMODELLED = re.compile(r"^(?P<section>[\w.\[\]]+): (?P<keys>.*): not modelled by ms_llm; dropped$")
TOP_LEVEL = re.compile(r"^(?P<path>[\w.\[\]]+)( = .*)?: not modelled by ms_llm; dropped$")
SECTION = re.compile(r"^(?P<path>[\w.\[\]]+): section not modelled by ms_llm")
CALLBACK = re.compile(r"^(?P<path>callbacks\[\d+\])[ =].*not modelled.*dropped$")


def options(path: Path) -> tuple[ReadOptions, str]:
    if path.stem.startswith(WORLD_SIZE_8):
        return ReadOptions(world_size=8), "--world-size 8"
    if path.stem.startswith("llm_pretrain"):
        return ReadOptions(model=load_section("model", "llama2_7b")), "--model llama2_7b"
    return ReadOptions(), ""


def keys(warning: str) -> tuple[list[str], bool]:
    """The source keys one warning names, and whether it is only "not modelled" (a key ms_llm
    ignores) rather than a setting the IR cannot express."""
    if m := UNMODELLED.match(warning):
        return [f"{m['section']}.{pair.split(' = ')[0]}" for pair in re.split(r", (?=\w+ = )", m["keys"])], True
    if (m := SECTION.match(warning)) or (m := TOP_LEVEL.match(warning)) or (m := CALLBACK.match(warning)):
        return [m["path"]], True
    return [re.split(r"[ :]", warning, maxsplit=1)[0]], False


def main(root: Path) -> int:
    files = sorted(root.glob("*/*pretrain*.yaml"))
    print("| file | converts | flags | model / strategy keys the IR cannot express (warned) | other keys dropped |")
    print("|---|---|---|---|---|")
    for path in files:
        opts, flags = options(path)
        try:
            conv = load(path, "mindformers", opts)
        except MsLlmError as exc:
            print(f"| {path.relative_to(root)} | no | {flags} | refused: {str(exc).split(': ', 1)[1]} | |")
            continue
        math, other = set(), set()
        for w in conv.warnings:
            named, unmodelled = keys(w)
            for key in named:
                (other if unmodelled and not key.startswith("model") else math).add(key)
        print(f"| {path.relative_to(root)} | yes ({conv.world_size} devices) | {flags} | "
              f"{', '.join(sorted(math))} | {len(other)} (runtime, logging, paths) |")
    return 0


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / ".oracles" / "configs"
    raise SystemExit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
