"""bench/: every script answers --help without running its benchmark; bench/_results.py writes a
bench's output under the machine and the date (a rerun replaces that bench's section), and nothing
for a failed one; gpu_mfu.py checks its
arguments against the cost model before it looks for a GPU; moe.py --quick prints its two tables."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(p for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHES, ids=lambda p: p.name)
def test_help_describes_the_bench_and_runs_nothing(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: ") and "--help" in out.stdout


def test_results_appends_each_bench_under_the_machine_and_date(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text('"""A bench that prints\na ratio."""\nimport sys\nprint("ratio", sys.argv[1:])\n')
    bad.write_text('import sys\nprint("half a table")\nsys.exit("bench failed: no result")\n')
    results = tmp_path / "latest.md"
    helper = [sys.executable, str(ROOT / "bench" / "_results.py"), str(results)]
    ran = subprocess.run(helper + [str(good), "--x", "1"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout == "ratio ['--x', '1']\n"        # the terminal still sees it
    failed = subprocess.run(helper + [str(bad)], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and "bench failed: no result" in failed.stderr
    text = results.read_text()
    assert text.startswith(f"## {good.as_posix()}: A bench that prints a ratio.\n\nmachine: ")
    machine = text.splitlines()[2]
    assert " cores, " in machine and "GiB memory; date: 20" in machine
    assert "```\nratio ['--x', '1']\n```" in text and "half a table" not in text


def test_results_rerun_replaces_only_that_bench_section(tmp_path):
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text('"""First."""\nimport sys\nprint("first", sys.argv[1:])\n')
    second.write_text('"""Second."""\nprint("second")\n')
    results = tmp_path / "latest.md"
    results.write_text("# Benchmark results\n\n")
    helper = [sys.executable, str(ROOT / "bench" / "_results.py"), str(results)]
    for args in ([str(first), "old"], [str(second)], [str(first), "new"]):
        assert subprocess.run(helper + args, capture_output=True, timeout=60).returncode == 0
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\n## ") and text.count("## ") == 2
    assert text.index("first ['new']") < text.index("second") and "first ['old']" not in text


def test_gpu_mfu_checks_model_and_fit_before_it_needs_a_gpu():
    spec = importlib.util.spec_from_file_location("gpu_mfu", ROOT / "bench" / "gpu_mfu.py")
    gpu_mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_mfu)
    job = gpu_mfu.job_for(gpu_mfu.parse_args([]), "h100")
    assert 1.0 < job.model.num_params() / 1e9 < 1.6 and job.strategy.precision.compute_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--model: llama2_13b has 13.0B parameters"):
        gpu_mfu.job_for(gpu_mfu.parse_args(["--model", "llama2_13b"]), "h100")
    with pytest.raises(ConfigError, match="llama2_7b needs ~[0-9]+ GB by ms_llm's cost model, more than one 80 GB"):
        gpu_mfu.job_for(gpu_mfu.parse_args(["--model", "llama2_7b"]), "h100")


@pytest.mark.slow                # runs the MoE bench (about 19 CPU s): CI, not the inner loop
def test_moe_bench_quick_prints_both_tables():
    """bench/moe.py --quick: the expert-compute table (torch MoE grouped, dense, padded, loop, the
    MindSpore layer, each timed and against dense), the activation memory of one layer's forward (the
    dispatch's (E, C, H) buffers below every expert over every token's (E, N, H)) and the ep1 / ep2 /
    ep4 / ep2 x etp2 table with the experts' memory per rank, the cost model's equal to the tensors held,
    at tiny shapes."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--quick"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("expert compute: 8 experts top-2, hidden 32, expert width 16 (dense width 32), "
                               "64 tokens")
    assert lines[1].split() == ["layer", "wall", "ms", "vs", "dense", "CPU", "ms", "vs", "dense", "first", "call", "s"]
    number = r"\s+\d+\.\d+"
    for i, name in enumerate(["torch MoE, grouped", "dense SwiGLU", "torch MoE, padded bmm", "torch MoE, loop (old)",
                              "MindSpore MoE, cap 1.25", "MindSpore MoE, dropless"]):
        assert re.fullmatch(re.escape(name) + 5 * number, lines[2 + i]), lines[2 + i]
    assert lines[3].split()[3] == lines[3].split()[5] == "1.00"      # the dense layer against itself
    assert re.fullmatch(r"MoE / dense: \d+\.\d\d wall, \d+\.\d\d CPU \(goal <= 1\.5 wall: (met|missed)\); "
                        r"loop \(old\) / grouped: \d+\.\d", lines[8]), lines[8]
    assert re.fullmatch(r"MindSpore MoE \(capacity 1\.25\) / torch dense: \d+\.\d\d wall \(goal <= 1\.5 wall: "
                        r"(met|missed)\); dropless / capacity 1\.25: \d+\.\d", lines[9]), lines[9]
    assert lines[10].startswith("activation memory: bytes one layer's forward keeps for backward"), lines[10]
    assert lines[11].split() == ["layer", "saved", "MB", "vs", "every"]
    saved = {}
    for i, name in enumerate(["torch MoE, grouped", "padded (E, C, H)", "padded, cap 1.25", "every expert (E, N, H)",
                              "dense SwiGLU"]):
        assert re.fullmatch(re.escape(name) + 2 * number, lines[12 + i]), lines[12 + i]
        saved[name] = float(lines[12 + i].split()[-2])
    assert lines[15].split()[-1] == "1.000"                          # every expert against itself
    assert 0 < saved["padded (E, C, H)"] < saved["every expert (E, N, H)"]
    assert re.fullmatch(r"dispatch \(E, C, H\) / every expert \(E, 64, H\): 0\.\d{3} dropless, 0\.\d{3} at capacity "
                        r"1\.25 \(C <= 20\)", lines[17]), lines[17]
    assert lines[18] == "" and lines[19].startswith("expert parallel: tiny_moe (8 experts, top-2")
    assert [line.split()[0] for line in lines[21:]] == ["ep1", "ep2", "ep4", "ep2_etp2"]
    assert all(len(line.split()) == 10 for line in lines[21:])
    assert all(line.split()[-2] == line.split()[-1] for line in lines[21:])     # expert MB: model = measured
