"""A "billion laughs" config is refused by `grpo-run` itself: one line, exit 2 (issue 34, item 9)."""

# 9**8 leaves from nine lines of aliases in the free-form model.architecture mapping.
BOMB = "model:\n  architecture:\n    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))


def test_print_config_refuses_a_billion_laughs_file(tmp_path, grpo_cli):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(bomb.read_bytes()) <= 700
    # No time is asserted; the timeout only turns a regression (minutes of expansion) into a failure.
    done = grpo_cli.run(grpo_cli.argv("--config", str(bomb), "--print-config"), timeout=30)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-run: error: ")
    assert "MAX_EXPANDED_NODES" in lines[0] and done.stdout == ""
