"""`grpo-run export`: a tiny run's checkpoint becomes an HF directory that loads back with
the same params and forward pass, in grpo_core and (when torch is installed) transformers."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.config_io import load_config
from grpo_core.models import load_pretrained
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.cli import main as grpo_run
from grpo_runner_gsm8k.commands.export import load_policy

STEPS = 2
PROMPTS = ["<|im_start|>user\n3+4=<|im_end|>\n", "2+5="]


def by_path(state) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree.leaves_with_path(state)}


@pytest.fixture(scope="module")
def trained(tiny_config_path, small_run, tmp_path_factory):
    """(run dir, the trainer after a finished tiny run)."""
    from grpo_runner_gsm8k.loop import Trainer, build_run

    run_dir = tmp_path_factory.mktemp("run")
    registry = default_registry()
    overrides = [*small_run(STEPS), "checkpoint.every_steps=1", f"logging.dir={run_dir}"]
    trainer = Trainer(build_run(load_config(tiny_config_path, overrides, registry=registry), registry))
    trainer.run()
    return run_dir, trainer


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    assert grpo_run(["export", "--run-dir", str(trained[0]), "--out", str(out)]) == 0
    return out


def batch(tokenizer) -> dict:
    return tokenizer(PROMPTS, padding=True, add_special_tokens=False, return_tensors="np")


def our_logits(model, tokenizer) -> np.ndarray:
    inputs = batch(tokenizer)
    hidden = model(jnp.asarray(inputs["input_ids"]), attention_mask=jnp.asarray(inputs["attention_mask"]))
    return np.asarray(model.logits(hidden))  # [B, T, V]


def test_export_writes_config_weights_and_tokenizer(exported):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).is_file(), name


def test_exported_params_equal_the_trained_params(trained, exported):
    _, trainer = trained
    loaded = by_path(nnx.state(load_pretrained(exported, dtype="float32")))
    final = by_path(trainer.state.params)
    assert loaded.keys() == final.keys()
    for path, value in final.items():
        np.testing.assert_array_equal(loaded[path], value, err_msg=path)


def test_exported_forward_equals_the_checkpoint_forward(trained, exported):
    run_dir, trainer = trained
    from_checkpoint, tokenizer = load_policy(run_dir, STEPS)
    from_export = load_pretrained(exported, dtype="float32")
    np.testing.assert_array_equal(our_logits(from_export, tokenizer), our_logits(from_checkpoint, tokenizer))


def test_transformers_loads_the_export(trained, exported):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model, tokenizer = load_policy(trained[0], STEPS)
    # The run's character tokenizer is a plain fast tokenizer; AutoTokenizer in transformers 5
    # would force Qwen2Tokenizer (byte-level) on any qwen2 directory and drop "\n".
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(exported)
    assert hf_tokenizer(PROMPTS, add_special_tokens=False)["input_ids"] == \
        tokenizer(PROMPTS, add_special_tokens=False)["input_ids"]
    hf_model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    inputs = batch(tokenizer)
    mask = inputs["attention_mask"]
    with torch.no_grad():
        hf = hf_model(input_ids=torch.from_numpy(inputs["input_ids"]), attention_mask=torch.from_numpy(mask),
                      position_ids=torch.from_numpy(np.maximum(mask.cumsum(1) - 1, 0))).logits.numpy()
    ours = our_logits(model, tokenizer)
    real = mask.astype(bool)  # padded positions differ by convention only
    np.testing.assert_allclose(hf[real], ours[real], rtol=1e-4, atol=1e-5)


def test_export_of_an_earlier_step(trained, tmp_path):
    run_dir, trainer = trained
    assert grpo_run(["export", "--run-dir", str(run_dir), "--out", str(tmp_path), "--step", "1"]) == 0
    step_1 = by_path(nnx.state(load_pretrained(tmp_path, dtype="float32")))
    final = by_path(trainer.state.params)
    assert any(not np.array_equal(step_1[path], value) for path, value in final.items())


@pytest.mark.parametrize("case, expected", [
    ("missing run dir", "is not a directory"),
    ("no checkpoint", "holds no complete checkpoint"),
    ("absent step", "--step 7: "),
    ("no --out", "the following arguments are required: --out"),
])
def test_bad_export_input_is_one_line_exit_2(trained, tmp_path, capsys, case, expected):
    run_dir = str(trained[0])
    argv = {"missing run dir": ["--run-dir", str(tmp_path / "absent"), "--out", str(tmp_path / "out")],
            "no checkpoint": ["--run-dir", str(tmp_path), "--out", str(tmp_path / "out")],
            "absent step": ["--run-dir", run_dir, "--out", str(tmp_path / "out"), "--step", "7"],
            "no --out": ["--run-dir", run_dir]}[case]
    assert grpo_run(["export", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-run: error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-run: error: "), lines
    return lines[0]


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_export_refuses_a_non_empty_out_without_force(trained, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    before = _contents(tmp_path)
    assert grpo_run(["export", "--run-dir", str(trained[0]), "--out", str(tmp_path)]) == 2
    message = _one_error_line(capsys)
    assert f"--out {str(tmp_path)!r} is not empty (holds notes.txt)" in message and "pass --force" in message
    assert _contents(tmp_path) == before


def test_export_never_replaces_weights_it_did_not_write_even_with_force(trained, tmp_path, capsys):
    """A base model's directory: its weights and index stay byte for byte."""
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json"):
        (tmp_path / name).write_bytes(b"base model " + name.encode())
    before = _contents(tmp_path)
    assert grpo_run(["export", "--run-dir", str(trained[0]), "--out", str(tmp_path), "--force"]) == 2
    message = _one_error_line(capsys)
    assert "holds weights this export did not write (model-00001-of-00002.safetensors, " \
           "model.safetensors.index.json)" in message
    assert _contents(tmp_path) == before


def test_export_with_force_replaces_its_own_export_and_keeps_other_files(trained, tmp_path):
    run_dir = str(trained[0])
    assert grpo_run(["export", "--run-dir", run_dir, "--out", str(tmp_path), "--step", "1"]) == 0
    (tmp_path / "notes.txt").write_text("mine")
    assert grpo_run(["export", "--run-dir", run_dir, "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"
    exported = by_path(nnx.state(load_pretrained(tmp_path, dtype="float32")))
    final = by_path(trained[1].state.params)
    assert all(np.array_equal(exported[path], value) for path, value in final.items())
