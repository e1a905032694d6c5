import json

from grpo_core.models import bench


def test_bench_prints_one_json_line(capsys):
    assert bench.main(["--family", "qwen3", "--batch", "2", "--seq", "16", "--iters", "1", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["family"] == "qwen3" and result["forward_tokens_per_s"] > 0
    assert isinstance(result["compiled_temp_bytes"], int) and result["shape"]["head_dim"] == 16


def test_bench_shape_flags_override_preset():
    args = bench.argument_parser().parse_args(["--preset", "qwen2.5-0.5b", "--layers", "2", "--hidden", "128", "--heads", "2"])
    cfg = bench.build_config(args)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (2, 128, 2, 64)
