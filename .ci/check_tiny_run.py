"""Checks the README main run: its final checkpoint is complete and it learned.

    python .ci/check_tiny_run.py RUN_DIR CONFIG

Learned = the mean total reward of the last 20 logged steps is at least 0.5; chance on
the tiny arithmetic task is ~0.02 and a healthy run ends near 0.9. Prints one JSON line;
exits 1 with the reason otherwise.
"""

import json
import sys
from pathlib import Path

import yaml

MIN_LAST20_REWARD = 0.5


def main(run_dir: Path, config: Path) -> int:
    steps = yaml.safe_load(config.read_text())["train"]["steps"]
    final = run_dir / "checkpoints" / str(steps)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last20 = [r["train-reward/total/mean"] for r in records[-20:]]
    summary = {"final_checkpoint": str(final), "complete": (final / "params").is_dir(),
               "logged_steps": len(records), "last20_reward_mean": sum(last20) / len(last20)}
    print(json.dumps(summary))
    if not summary["complete"] or [r["step"] for r in records] != list(range(1, steps + 1)):
        print(f"check failed: expected steps 1..{steps} logged and a complete checkpoint {final}", file=sys.stderr)
        return 1
    if summary["last20_reward_mean"] < MIN_LAST20_REWARD:
        print(f"check failed: last-20 reward {summary['last20_reward_mean']:.3f} < {MIN_LAST20_REWARD}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
