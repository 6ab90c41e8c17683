"""DeepSeek-V3 671B on 2048 H800: ms_llm's cost-model estimate of the shipped job
(configs/train/deepseek_v3_671b_h800.yaml: pp16, ep64, ZeRO-1 dp128, no tp) against DeepSeek's published
training cost (2.664M H800 GPU-hours for 14.8T tokens: 180K GPU-hours per trillion tokens).

    .venv/bin/python bench/deepseek_cost.py

The estimate is the plan's as `ms-llm plan` prints it. The rows after it price, with the same model,
what DeepSeek ran that the IR does not express (FP8 GEMMs, DualPipe's all-to-all overlap and bubble),
each added to the row above, to show where the gap lies. No hardware runs: the cost model only.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.job import CONFIG_ROOT, load_job  # noqa: E402
from ms_llm.strategy.cost import estimate, model_flops_per_token  # noqa: E402
from ms_llm.strategy.devices import get_device  # noqa: E402
from ms_llm.strategy.plan import plan  # noqa: E402
from ms_llm.strategy.report import model_params_text, strategy_summary  # noqa: E402

JOB = CONFIG_ROOT / "train" / "deepseek_v3_671b_h800.yaml"
# DeepSeek-V3 technical report (arXiv 2412.19437), section 1 and table 1: pre-training on 14.8T tokens
# took 2664K H800 GPU-hours, 180K GPU-hours per trillion tokens.
PUBLISHED_GPU_HOURS_PER_T = 180e3
PUBLISHED_TOKENS_PER_S = 1e12 / (PUBLISHED_GPU_HOURS_PER_T * 3600)
FP8_PEAK = 1979e12                 # H800 SXM dense FP8 (NVIDIA)


def tokens_per_s(tokens_per_step: int, step_s: float, world: int) -> float:
    return tokens_per_step / step_s / world


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()     # --help only
    job = load_job(JOB)
    device = get_device(job.device)
    p = plan(job.model, job.strategy, job.train)
    est = estimate(p, device)
    world, tokens = est.world_size, est.tokens_per_step
    flops = model_flops_per_token(job.model, job.train.seq_len)
    print(f"job        {JOB.relative_to(CONFIG_ROOT.parent)}: {job.model.name} ({model_params_text(job.model)})")
    print(f"           {world} x {device.name}; {strategy_summary(p)}")
    print(f"           {job.train.global_batch_size} x {job.train.seq_len} tokens a step; "
          f"{flops / 1e9:.0f} GFLOP a token (6 x activated parameters + causal attention + MTP)")
    mem = est.memory
    print(f"step       compute {est.compute_s:.2f} s + bubble {est.bubble_s:.2f} s + exposed "
          + " + ".join(f"{axis} {s:.2f} s" for axis, s in est.exposed_comm_s.items() if s)
          + f" = {est.step_s:.2f} s")
    print(f"memory     {mem.total / 1e9:.1f} GB on the busiest GPU (stage {mem.stage}): params {mem.params / 1e9:.1f}, "
          f"grads {mem.grads / 1e9:.1f}, optimizer {mem.optimizer / 1e9:.1f}, activations "
          f"{mem.activations / 1e9:.1f}, logits {mem.logits / 1e9:.1f}")
    print()
    published_mfu = PUBLISHED_TOKENS_PER_S * flops / device.peak_flops
    print(f"{'':52s}{'estimate':>12s}{'published':>12s}{'ratio':>8s}")
    print(f"{'tokens/s per GPU':52s}{est.tokens_per_s_per_device:12,.0f}{PUBLISHED_TOKENS_PER_S:12,.0f}"
          f"{est.tokens_per_s_per_device / PUBLISHED_TOKENS_PER_S:8.2f}")
    hours = 1e12 / est.tokens_per_s_per_device / 3600
    print(f"{'H800 GPU-hours per trillion tokens':52s}{hours / 1e3:11,.0f}K{PUBLISHED_GPU_HOURS_PER_T / 1e3:11,.0f}K"
          f"{hours / PUBLISHED_GPU_HOURS_PER_T:8.2f}")
    print(f"{'model FLOPs utilisation (of the 989 TFLOP/s bf16)':52s}{100 * est.mfu:11.1f}%{100 * published_mfu:11.1f}%"
          f"{est.mfu / published_mfu:8.2f}")
    print(f"{'memory per GPU (GB)':52s}{mem.total / 1e9:12.1f}{'< 80':>12s}{'':8s}  (no tp; no figure published)")
    print()
    print("what DeepSeek ran beyond the IR, each row adding to the one above (same cost model):")
    fp8 = estimate(p, dataclasses.replace(device, peak_flops=FP8_PEAK))
    rows = [("as planned: bf16 GEMMs, 1F1B, all-to-all exposed", est.step_s),
            ("FP8 peak for every GEMM (an upper bound)", fp8.step_s)]
    # DualPipe runs one micro-batch's all-to-all under another's compute: exposed only past the compute.
    ep = fp8.exposed_comm_s.get("ep", 0.0)
    overlapped = fp8.step_s - ep + max(0.0, ep - fp8.compute_s)
    rows.append(("+ all-to-all under compute (DualPipe's overlap)", overlapped))
    rows.append(("+ no pipeline bubble (DualPipe's two-way fill)", overlapped - fp8.bubble_s))
    for label, step in rows:
        rate = tokens_per_s(tokens, step, world)
        print(f"  {label:50s}{rate:12,.0f}{PUBLISHED_TOKENS_PER_S:12,.0f}{rate / PUBLISHED_TOKENS_PER_S:8.2f}")


if __name__ == "__main__":
    main()
