"""Validate a job and print its plan: mesh and rank groups, pipeline stages, memory per device,
communication and estimated step time, then whether the backend runs it on the device's
accelerator and with which ZeRO engine (exit status 2 when it refuses).

examples:
  ms-llm plan configs/train/llama2_70b_dp2_tp4_pp8.yaml
  ms-llm plan configs/train/llama2_7b_dp8_zero1.yaml --set strategy.zero.stage=3 --device h100
"""
from __future__ import annotations

import argparse
import json
import sys

from ms_llm.commands import add_job_arguments, job_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument("--world-size", type=int, default=None, help="devices; default: from the strategy")
    parser.add_argument("--device", default=None, help="h100, h800, h200, a100, 910b or cpu; default: the job's device")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--backend", choices=("torch", "mindspore"), default=None,
                        help="report this backend's ZeRO engine and every refusal on the device's accelerator "
                             "(exit status 2 when refused); default: the job's backend")


def run(args: argparse.Namespace) -> int:
    from ms_llm.backends import verdict
    from ms_llm.job import load_job
    from ms_llm.machine import Machine
    from ms_llm.strategy.cost import estimate
    from ms_llm.strategy.devices import get_device
    from ms_llm.strategy.plan import plan
    from ms_llm.strategy.report import plan_json, plan_report

    job = load_job(args.config, job_overrides(args))
    device = get_device(args.device or job.device)
    p = plan(job.model, job.strategy, job.train, args.world_size)
    est = estimate(p, device)
    answer = verdict(args.backend or job.backend, p, Machine.running(device))
    if args.json:
        print(json.dumps({**plan_json(p, est, device), "backend": answer.to_json()}, indent=2))
    else:
        print(plan_report(p, est, device))
        print()
        print("\n".join(answer.lines()))
    if answer.runs:
        return 0
    print(f"ms-llm plan: {answer.backend} cannot run this plan on {answer.machine.accelerator} "
          f"({len(answer.refusals)} refusal(s), listed above)", file=sys.stderr)
    return 2
