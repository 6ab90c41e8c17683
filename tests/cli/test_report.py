"""`ms-llm report`: two run folders written through the trainers' own MetricsLogger (a torch run
restarted once from its step-4 checkpoint, a MindSpore run continuing it from step 6), one loss
plot, one throughput plot, summary.md; and a folder that is not a run, refused in one line."""
import math

import matplotlib.image

from ms_llm.cli import main
from ms_llm.commands.report import read_run
from ms_llm.job import dump_yaml, job_from_dict, job_to_dict
from ms_llm.run.metrics import MetricsLogger, StepMetrics, read_metrics


def make_run(folder, backend, launches, recovered=None):
    """launches: [(resumed_step or None, first step, last step)]; loss 4 - 0.2 * step, 0.01 more after a resume."""
    folder.mkdir()
    job = job_from_dict({"name": "t", "backend": backend, "model": "tiny", "strategy": {"dp": 2},
                         "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": 10}})
    (folder / "config.yaml").write_text(dump_yaml(job_to_dict(job)))
    for resumed, first, last in launches:
        log = MetricsLogger(folder / "metrics.jsonl", total_steps=10, every=100)
        if resumed is not None:
            log.event(resumed_from="ckpt", resumed_step=resumed, load_s=0.25 * resumed, load_bytes=3_200_000)
        for s in range(first, last + 1):
            m = StepMetrics(step=s, loss=4 - 0.2 * s + 0.01 * (resumed is not None), lr=1e-3, tokens_per_s=100.0 * s, mfu=0.001 * s, memory_gb=0.5)
            if s % 3 == 0:
                m.extra["val_loss"] = 4.1 - 0.2 * s
            log.log(m)
        log.close()
    if recovered is not None:          # the elastic supervisor's own records
        with open(folder / "metrics.jsonl", "a") as f:
            f.write('{"event": "failure", "kind": "exit", "ranks": [1], "step": 5}\n')
            f.write(f'{{"event": "recovered", "recovery_s": {recovered}, "cause": "exit", "world": 2}}\n')
    return folder


def test_report_of_a_torch_run_and_the_mindspore_run_continuing_it(tmp_path, capsys):
    torch_run = make_run(tmp_path / "torch_run", "torch", [(None, 1, 5), (4, 5, 6)], recovered=2.5)
    ms_run = make_run(tmp_path / "ms_run", "mindspore", [(6, 7, 10)])

    runs = [read_run(torch_run), read_run(ms_run)]
    assert sorted(runs[0].steps) == [1, 2, 3, 4, 5, 6] and runs[0].resumes == [4] and runs[0].restarts == 1
    assert runs[0].failures == [(5, "exit")] and runs[0].recovery_s == [2.5]
    assert runs[1].resumes == [6] and runs[1].restarts == 0          # a continuation, not a restart
    replayed = [r["loss"] for r in read_metrics(torch_run / "metrics.jsonl") if r.get("step") == 5 and "loss" in r]
    assert replayed == [3.0, 3.01] and runs[0].steps[5]["loss"] == 3.01     # the relaunch's record of step 5 wins

    assert main(["report", str(torch_run), str(ms_run)]) == 0
    out = torch_run / "report"
    assert capsys.readouterr().out.split() == ["wrote", str(out / "loss.png"), "wrote", str(out / "throughput.png"),
                                               "wrote", str(out / "summary.md")]
    for png in ("loss.png", "throughput.png"):
        height, width, _ = matplotlib.image.imread(out / png).shape
        assert height > 300 and width > 600
    summary = (out / "summary.md").read_text()
    assert "![loss](loss.png)" in summary and "![throughput](throughput.png)" in summary
    rows = [line.strip("| ").split(" | ") for line in summary.splitlines() if line.startswith("| torch_run") or
            line.startswith("| ms_run")]
    torch_row, ms_row = rows
    assert torch_row[1:3] == ["torch", "dp2, bfloat16 params / bfloat16 compute / float32 master"]
    assert torch_row[3:6] == ["1-6", f"{4 - 1.2 + 0.01:.4f}", f"{4.1 - 1.2:.4f}"]
    assert torch_row[6] == "400" and torch_row[8:] == ["1", "2.5 s", "1.00 s (3.2 MB)"]   # median of steps 2-6
    assert ms_row[1] == "mindspore" and ms_row[3:5] == ["7-10", f"{4 - 2.0 + 0.01:.4f}"] and ms_row[8] == "0"
    assert ms_row[10] == "1.50 s (3.2 MB)"
    assert math.isclose(float(ms_row[7].rstrip("%")), 0.9)                # median MFU of steps 8-10, in %


def test_a_folder_without_metrics_is_refused_in_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ms-llm report: error: {tmp_path}: holds no metrics.jsonl; give a run folder `ms-llm train` wrote"
