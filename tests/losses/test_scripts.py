"""The benchmark command and the standalone CI script run and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from grpo_losses import bench


def test_bench_prints_one_json_line(capsys):
    bench.main(["--impl", "fused", "--batch", "2", "--time", "24", "--vocab", "300", "--hidden", "16",
                "--block-size", "128", "--time-block", "16", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["impl"] == "fused" and record["shape"] == {"batch": 2, "time": 24, "vocab": 300, "hidden": 16}
    assert record["temp_bytes_fwd"] > 0 and record["temp_bytes_fwd_bwd"] > 0
    assert record["median_fwd_bwd_ms"] > 0
    assert max(record["max_abs_diff_vs_jax"].values()) < 1e-4


def test_bench_runs_cispo_and_sapo_with_token_advantages(capsys):
    for policy_loss in ("cispo", "sapo"):
        bench.main(["--impl", "fused", "--batch", "2", "--time", "24", "--vocab", "300", "--hidden", "16",
                    "--block-size", "128", "--time-block", "16", "--repeats", "1", "--policy-loss", policy_loss,
                    "--token-advantages"])
        record = json.loads(capsys.readouterr().out)
        assert record["policy_loss"] == policy_loss and record["advantages"] == [2, 24]
        assert max(record["max_abs_diff_vs_jax"].values()) < 1e-4


def test_bench_compile_only_reports_memory_without_running(capsys):
    bench.main(["--impl", "jax", "--batch", "1", "--time", "8", "--vocab", "64", "--hidden", "8", "--no-run"])
    record = json.loads(capsys.readouterr().out)
    assert record["temp_bytes_fwd_bwd"] > 0 and record["median_fwd_bwd_ms"] is None


def test_standalone_check_script():
    script = Path(__file__).with_name("standalone_check.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["grad_norm"] > 0
