"""A reward model's score (grpo_core.models.sequence_scores) against transformers'.

The golden directories golden/reward_{qwen2,llama3} hold tiny random Qwen2/Llama
*ForSequenceClassification models saved by transformers (num_labels=1, pad_token_id=0) and
transformers' float32 scores, made by make_reward_golden.py (see there; needs torch). The bound
1e-4 is the issue's float32 requirement; the observed difference is ~1e-6 (op order).
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.models import load_pretrained
from grpo_core.models.sequence_scores import SCORE_HEAD, ScoreHead, last_scored_token, sequence_scores

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden")
FAMILIES = ("reward_qwen2", "reward_llama3")
PARITY_ATOL = 1e-4


def golden_of(name: str) -> dict:
    with open(os.path.join(GOLDEN, name, "golden.json")) as f:
        return json.load(f)


def our_scores(path: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    head = ScoreHead.read(path)
    model = load_pretrained(path, dtype="float32", config=head.decoder, skip={SCORE_HEAD})
    index = last_scored_token(ids, mask, head.pad_token_id)
    return np.asarray(sequence_scores(model, jnp.asarray(head.weight(np.float32)), jnp.asarray(ids),
                                      jnp.asarray(mask), jnp.asarray(index)))


@pytest.mark.parametrize("name", FAMILIES)
def test_scores_match_transformers(name):
    golden = golden_of(name)
    ids, mask = np.asarray(golden["input_ids"], np.int32), np.asarray(golden["attention_mask"], np.int32)
    diff = np.abs(our_scores(os.path.join(GOLDEN, name), ids, mask) - np.asarray(golden["scores"]))
    assert diff.max() <= PARITY_ATOL, diff


def test_last_scored_token_is_the_rightmost_non_pad_id():
    ids = np.array([[5, 6, 7, 0], [5, 0, 0, 0], [0, 0, 0, 0], [0, 0, 8, 9], [5, 6, 0, 0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 0]])
    # row 1: its real second token is the pad id, so the first is scored (transformers' rule)
    assert last_scored_token(ids, mask, pad_token_id=0).tolist() == [2, 0, 0, 3, 1]
    assert last_scored_token(ids, mask, pad_token_id=None).tolist() == [2, 1, 0, 3, 2]


def copy_golden(tmp_path, name="reward_qwen2"):
    path = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_refuses_two_labels(tmp_path):
    path = copy_golden(tmp_path)
    edit_config(path, id2label={"0": "bad", "1": "good"})
    with pytest.raises(ValueError, match=r"num_labels is 2 .*one label"):
        ScoreHead.read(str(path))


def test_refuses_a_causal_lm_without_score_head():
    with pytest.raises(ValueError, match=r"has no score.weight tensor .*ForSequenceClassification"):
        ScoreHead.read(os.path.join(GOLDEN, "qwen2_untied"))


def test_refuses_an_unknown_family(tmp_path):
    path = copy_golden(tmp_path)
    edit_config(path, model_type="bert")
    with pytest.raises(ValueError, match="bert"):
        ScoreHead.read(str(path))


def test_golden_still_matches_current_transformers():
    """The committed scores are what the installed transformers computes from the committed weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in FAMILIES:
        golden, path = golden_of(name), os.path.join(GOLDEN, name)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model(input_ids=torch.tensor(golden["input_ids"]), attention_mask=torch.tensor(golden["attention_mask"]))
        assert np.abs(out.logits[:, 0].numpy() - np.asarray(golden["scores"])).max() <= 1e-6
