"""`speclm.data.torch_replies.generate`: a Llama's own replies in PyTorch, batched with left
padding, against transformers' forward pass of the same weights."""

import numpy as np
import pytest

from speclm.models import llama

torch = pytest.importorskip('torch')
from speclm.checkpoints import hf_llama  # pylint: disable=g-import-not-at-top
from speclm.data import torch_replies  # pylint: disable=g-import-not-at-top

PROMPTS = [[5, 9, 13, 2, 40, 7, 7, 31], [3], [11, 12, 13, 14], [60, 1, 8, 22, 35, 50]]


@pytest.fixture(scope='module')
def hf_model():
  target = llama.random_model(vocab_size=64, embed_dim=48, num_layers=3, num_heads=6,
                              num_kv_heads=2, seed=7)
  return hf_llama.to_transformers(target).eval()


def _logits(hf_model, ids):
  with torch.inference_mode():
    return hf_model(torch.tensor([ids])).logits[0].double().numpy()


def test_greedy_replies_are_transformers_argmax_at_every_position(hf_model):
  replies = torch_replies.generate(hf_model, PROMPTS, 12, end_ids=[999], dtype=torch.float32)
  assert [len(r) for r in replies] == [12] * len(PROMPTS)
  for prompt, reply in zip(PROMPTS, replies):
    logits = _logits(hf_model, prompt + reply)[len(prompt) - 1:-1]  # those predicting the reply
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4  # not a near-tie, where rounding may decide
    assert clear.mean() > 0.8
    np.testing.assert_array_equal(np.asarray(reply)[clear], logits.argmax(-1)[clear])


def test_a_row_does_not_depend_on_the_others_or_their_padding(hf_model):
  together = torch_replies.generate(hf_model, PROMPTS, 10, end_ids=[999], dtype=torch.float32)
  alone = [torch_replies.generate(hf_model, [p], 10, end_ids=[999], dtype=torch.float32)[0]
           for p in PROMPTS]
  assert together == alone


def test_replies_stop_after_an_end_token(hf_model):
  free = torch_replies.generate(hf_model, PROMPTS, 10, end_ids=[999], dtype=torch.float32)
  end = free[0][3]  # the fourth token of the first reply becomes an end token
  stopped = torch_replies.generate(hf_model, PROMPTS, 10, end_ids=[end], dtype=torch.float32)
  assert stopped[0] == free[0][:free[0].index(end) + 1]
  for full, cut in zip(free, stopped):
    assert cut == full[:len(cut)] and (len(cut) == 10 or cut[-1] == end)
    assert end not in cut[:-1]


def test_sampled_replies_follow_the_seed_and_bfloat16_runs(hf_model):
  first = torch_replies.generate(hf_model, PROMPTS, 10, [999], temperature=1.0, seed=3)
  again = torch_replies.generate(hf_model, PROMPTS, 10, [999], temperature=1.0, seed=3)
  other = torch_replies.generate(hf_model, PROMPTS, 10, [999], temperature=1.0, seed=4)
  assert first == again and first != other
  assert all(0 <= t < 64 for reply in first for t in reply)
  # bfloat16 (the default): the first token agrees with float32 wherever the choice is clear
  greedy = torch_replies.generate(hf_model, PROMPTS, 1, [999])
  float32 = torch_replies.generate(hf_model, PROMPTS, 1, [999], dtype=torch.float32)
  margins = [np.diff(np.sort(_logits(hf_model, p)[-1])[-2:])[0] for p in PROMPTS]
  clear = [m > 0.05 for m in margins]
  assert any(clear)
  assert [g for g, c in zip(greedy, clear) if c] == [f for f, c in zip(float32, clear) if c]


def _hidden_states(hf_model, ids):
  with torch.inference_mode():
    out = hf_model(torch.tensor([ids]), output_hidden_states=True)
  return [h[0].double().numpy() for h in out.hidden_states], out.logits[0].double().numpy()


def _as_float(bits):
  return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_features_come_from_the_same_pass_as_the_replies(hf_model, temperature):
  kw = dict(temperature=temperature, seed=5, dtype=torch.float32)
  plain = torch_replies.generate(hf_model, PROMPTS, 9, [999], **kw)
  rows = torch_replies.generate_with_features(hf_model, PROMPTS, 9, [999], (1, 0), 4, **kw)
  assert [row.reply for row in rows] == plain
  for prompt, row in zip(PROMPTS, rows):
    ids = prompt + row.reply
    hidden, logits = _hidden_states(hf_model, ids)
    assert row.features.dtype == np.uint16 and row.features.shape == (len(ids), 2 * 48)
    # hidden_states[i + 1] is decoder layer i's output (the last layer's comes normed); the
    # layers side by side in the order asked for
    expected = np.concatenate([hidden[2], hidden[1]], axis=-1)
    np.testing.assert_allclose(_as_float(row.features), expected, rtol=1e-2, atol=1e-2)
    # soft labels from the prompt's last position on; zeros before it
    assert not row.probs[:len(prompt) - 1].any() and not row.ids[:len(prompt) - 1].any()
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.sort(probs, axis=-1)[:, ::-1][len(prompt) - 1:, :4]
    np.testing.assert_allclose(row.probs[len(prompt) - 1:], top, atol=2e-3)
    picked = np.take_along_axis(probs[len(prompt) - 1:], row.ids[len(prompt) - 1:], axis=-1)
    np.testing.assert_allclose(picked, top, atol=1e-5)


def test_final_features_are_the_heads_input_and_bad_layers_are_refused(hf_model):
  rows = torch_replies.generate_with_features(hf_model, PROMPTS[:2], 5, [999], 'final', 2,
                                              dtype=torch.float32)
  for prompt, row in zip(PROMPTS[:2], rows):
    hidden, _ = _hidden_states(hf_model, prompt + row.reply)
    np.testing.assert_allclose(_as_float(row.features), hidden[-1], rtol=1e-2, atol=1e-2)
  for layers in [(3,), (), (-1,)]:
    with pytest.raises(ValueError, match='decoder layers 0 … 2'):
      torch_replies.generate_with_features(hf_model, PROMPTS, 2, [999], layers, 2)
  with pytest.raises(ValueError, match='top_k'):
    torch_replies.generate_with_features(hf_model, PROMPTS, 2, [999], (1,), 0)


def test_a_second_teacher_forced_pass_gives_the_same_features_and_labels(hf_model):
  rows = torch_replies.generate_with_features(hf_model, PROMPTS[:1], 6, [999], (1, 0), 3,
                                              dtype=torch.float32)
  tokens = np.asarray([PROMPTS[0] + rows[0].reply])
  features, probs, ids = torch_replies.teacher_forced_features(hf_model, (1, 0), 3)(tokens)
  np.testing.assert_allclose(_as_float(features[0]), _as_float(rows[0].features), atol=2e-2)
  start = len(PROMPTS[0]) - 1  # where generate_with_features' labels begin
  np.testing.assert_allclose(probs[0, start:], rows[0].probs[start:], atol=2e-3)
