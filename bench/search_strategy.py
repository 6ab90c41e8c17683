"""Strategy search speed: the 70B-on-1024-devices search end to end, and the two ways of pricing one
strategy measured side by side (a full per-tensor ModelPlan vs the degrees-only CostShape the
search uses; both give identical estimates, tests/strategy/test_cost_shape.py holds them equal).

    .venv/bin/python bench/search_strategy.py [--runs 3] [--sample 100]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.config.train import TrainConfig  # noqa: E402
from ms_llm.job import load_section  # noqa: E402
from ms_llm.strategy.cost import estimate, shape_of  # noqa: E402
from ms_llm.strategy.devices import get_device  # noqa: E402
from ms_llm.strategy.plan import plan  # noqa: E402
from ms_llm.strategy.search import search  # noqa: E402
from ms_llm.strategy.validate import validate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="searches timed; the fastest is reported (default 3)")
    ap.add_argument("--sample", type=int, default=100, help="fitting strategies priced both ways (default 100)")
    args = ap.parse_args()
    model = load_section("model", "llama2_70b")
    train = TrainConfig(global_batch_size=1024, seq_len=4096)
    device = get_device("h100")
    runs = []
    for _ in range(args.runs):
        cpu = time.process_time()
        result = search(model, train, 1024, device)
        runs.append((result.seconds, time.process_time() - cpu))
    # Each the least of the runs: on a shared machine CPU time is the figure to compare, wall time waits.
    wall, cpu = min(w for w, _ in runs), min(c for _, c in runs)
    print(f"search llama2_70b on 1024 x h100: {result.enumerated} strategies, {result.priced} priced, "
          f"{len(result.ranked)} fit; best of {args.runs} runs {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"({1e6 * cpu / result.priced:.0f} us CPU per priced strategy)")

    sample = result.ranked[::20][:args.sample]
    start = time.process_time()
    full = [estimate(plan(model, c.strategy, c.train, 1024), device) for c in sample]
    t_full = time.process_time() - start
    start = time.process_time()
    fast = [estimate(shape_of(model, validate(model, c.strategy, c.train, 1024), c.train), device) for c in sample]
    t_fast = time.process_time() - start
    assert full == fast
    print(f"pricing {len(sample)} strategies (CPU time): ModelPlan {1e3 * t_full:.0f} ms, CostShape "
          f"{1e3 * t_fast:.0f} ms, ratio {t_full / t_fast:.0f}x (same estimates)")


if __name__ == "__main__":
    main()
