"""Strategy search speed: the 70B-on-1024-devices search end to end, and the two ways of pricing one
strategy measured side by side (a full per-tensor ModelPlan vs the degrees-only CostShape the
search uses; both give identical estimates, tests/test_cost_shape.py holds them equal)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.config.job import load_section  # noqa: E402
from ms_llm.config.train import TrainConfig  # noqa: E402
from ms_llm.strategy.cost import estimate, shape_of  # noqa: E402
from ms_llm.strategy.devices import get_device  # noqa: E402
from ms_llm.strategy.plan import plan  # noqa: E402
from ms_llm.strategy.search import search  # noqa: E402
from ms_llm.strategy.validate import validate  # noqa: E402


def main() -> None:
    model = load_section("model", "llama2_70b")
    train = TrainConfig(global_batch_size=1024, seq_len=4096)
    device = get_device("h100")
    runs = [search(model, train, 1024, device) for _ in range(3)]
    result = min(runs, key=lambda r: r.seconds)
    print(f"search llama2_70b on 1024 x h100: {result.enumerated} strategies, {result.priced} priced, "
          f"{len(result.ranked)} fit; best of 3 runs {result.seconds:.2f} s "
          f"({1e6 * result.seconds / result.priced:.0f} us per priced strategy)")

    sample = [c for c in result.ranked[::20]][:100]
    start = time.perf_counter()
    full = [estimate(plan(model, c.strategy, c.train, 1024), device) for c in sample]
    t_full = time.perf_counter() - start
    start = time.perf_counter()
    fast = [estimate(shape_of(model, validate(model, c.strategy, c.train, 1024), c.train), device) for c in sample]
    t_fast = time.perf_counter() - start
    assert full == fast
    print(f"pricing {len(sample)} strategies: ModelPlan {1e3 * t_full:.0f} ms, CostShape {1e3 * t_fast:.0f} ms, "
          f"ratio {t_full / t_fast:.1f}x (same estimates)")


if __name__ == "__main__":
    main()
