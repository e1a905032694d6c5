"""`grpo-run report`: metrics.jsonl -> a PNG with reward, eval accuracy, tokens/s and step time."""

import json

import matplotlib.image
import pytest

from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.commands.report import build_figure, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(step: int) -> dict:
    record = {"step": step, "train-reward/total/mean": step / 20, "train-reward/func/correctness/mean": step / 25,
              "train-reward/func/format/mean": 0.5, "throughput/train/valid_tokens_per_s": 1000.0 + step,
              "time/train/step_s": 0.2, "time/train/rollout_s": 0.05, "time/train/update_s": 0.15}
    if step % 5 == 0:
        record.update({"eval/accuracy": step / 20, "eval/pass@4": min(1.0, step / 10)})
    return record


def _write_run(run_dir, records: list[dict], tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_report_writes_a_png_of_the_expected_size(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_run(run_dir, [_record(s) for s in range(1, 21)])
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report.png"
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1200, 800)


def test_report_writes_to_out(tmp_path):
    run_dir = tmp_path / "run"
    _write_run(run_dir, [_record(s) for s in range(1, 4)])
    out = tmp_path / "plots" / "r.png"
    out.parent.mkdir()
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE and not (run_dir / "report.png").exists()


def test_figure_has_the_four_panels_with_every_series(tmp_path):
    run_dir = tmp_path / "run"
    # null = a non-finite value (left out); step 3 logged twice (the last record wins)
    records = [_record(1), {**_record(2), "time/train/step_s": None}, _record(3), {**_record(3), "step": 3,
               "train-reward/total/mean": 9.0}, _record(5)]
    _write_run(run_dir, records)
    figure = build_figure(read_metrics(run_dir / "metrics.jsonl"), "run")
    axes = {ax.get_title(): ax for ax in figure.axes}
    assert list(axes) == ["Reward", "Eval accuracy", "Tokens/s", "Step time"]
    lines = {title: {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()} for title, ax in axes.items()}
    assert lines["Reward"] == {"total (weighted)": [1, 2, 3, 5], "correctness": [1, 2, 3, 5], "format": [1, 2, 3, 5]}
    assert lines["Eval accuracy"] == {"accuracy": [5], "pass@4": [5]}
    assert lines["Step time"]["step"] == [1, 3, 5]
    reward_values = list(axes["Reward"].get_lines()[0].get_ydata())
    assert reward_values[2] == 9.0


def test_a_cut_off_last_line_is_left_out(tmp_path):
    run_dir = tmp_path / "run"
    _write_run(run_dir, [_record(1), _record(2)], tail='{"step": 3, "train-rew')
    with pytest.warns(UserWarning, match="cut off"):
        assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("content,hint", [
    (None, "not found"),
    ("", "holds no metrics"),
    ('{"step": 1}\nnot json\n{"step": 2}\n', "metrics.jsonl:2 is not valid JSON"),
    ('{"loss": 1.0}\n', "integer 'step'"),
], ids=["missing", "empty", "bad-line", "no-step"])
def test_bad_metrics_exit_2_with_one_line_and_no_image(content, hint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if content is not None:
        (run_dir / "metrics.jsonl").write_text(content)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-run: error: ") and hint in err[0], err
    assert not (run_dir / "report.png").exists()


def test_out_in_a_missing_directory_exits_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_run(run_dir, [_record(1)])
    assert main(["report", str(run_dir), "--out", str(tmp_path / "nope" / "r.png")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err


def test_eval_tasks_and_the_pass_at_k_plot(tmp_path, capsys):
    from grpo_runner_gsm8k.commands.pass_at_k_plot import eval_summaries, pass_at_k_figure

    run_dir = tmp_path / "run"
    _write_run(run_dir, [{**_record(5), "eval/countdown/greedy_accuracy": 0.25, "eval/countdown/by/level/1/x": 1.0}])
    figure = build_figure(read_metrics(run_dir / "metrics.jsonl"), "run")
    evals = next(ax for ax in figure.axes if ax.get_title() == "Eval accuracy")
    assert [line.get_label() for line in evals.get_lines()] == ["accuracy", "pass@4", "countdown/greedy_accuracy"]
    sampled = run_dir / "eval" / "step-5" / "math500"
    sampled.mkdir(parents=True)
    (sampled / "summary.json").write_text(json.dumps({"mean@4": 0.4, "pass@1": 0.4, "pass@2": 0.55, "pass@4": 0.7,
                                                      "maj@1": 0.4, "maj@2": 0.4, "maj@4": 0.5, "questions": 10}))
    (sampled.parent / "cut").mkdir()
    (sampled.parent / "cut" / "summary.json").write_text('{"pass@1": 0.')  # an eval still writing: left out
    summaries = eval_summaries(run_dir)
    assert list(summaries) == ["step-5/math500"]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in pass_at_k_figure(summaries).axes[0].get_lines()}
    assert lines == {"step-5/math500 pass@k": ([1, 2, 4], [0.4, 0.55, 0.7]),
                     "step-5/math500 maj@k": ([1, 2, 4], [0.4, 0.4, 0.5])}
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report-pass-at-k.png").read_bytes()[:8] == PNG_SIGNATURE
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {run_dir / 'report-pass-at-k.png'}"
