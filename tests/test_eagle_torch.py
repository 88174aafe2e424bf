"""The PyTorch training path of EAGLE-3 drafts (`speclm.models.eagle_torch`): the same logits
as the Flax `eagle.training_time_test`, gradients that flow, and a round trip of the
parameters."""

import jax
import numpy as np
import pytest

from speclm import trees
from speclm.models import eagle
from speclm.models import llama

torch = pytest.importorskip('torch')
from speclm.models import eagle_torch  # pylint: disable=g-import-not-at-top


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=48, embed_dim=32, num_layers=4, seed=4)


def _draft(target, num_layers, seed=1):
  draft = eagle.random_draft(target, num_layers=num_layers, head_size=40, seed=seed,
                             feature_layers=(0, 1, 3), input_norms=True)
  # norm scales away from 1, so that a norm read from the wrong place would show
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map(np.asarray, draft.params)
  for key in ('embedding_norm', 'feature_norm', 'final_norm'):
    params[key] = {'scale': rng.uniform(0.5, 1.5, params[key]['scale'].shape).astype(np.float32)}
  return draft.definition, params


@pytest.mark.parametrize('num_layers,steps', [(1, 3), (2, 2)])
def test_logits_equal_flax_training_time_test(target, num_layers, steps):
  definition, params = _draft(target, num_layers)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 48, (2, 9)).astype(np.int32)
  features = (rng.standard_normal((2, 9, definition.feature_dim)) * 3).astype(np.float32)
  want = np.asarray(eagle.training_time_test(definition, params, tokens, features, steps))
  module = eagle_torch.TorchEagle(definition, params)
  with torch.no_grad():
    got = module.training_time_test(torch.from_numpy(tokens).long(),
                                    torch.from_numpy(features), steps).numpy()
  assert got.shape == want.shape == (steps, 2, 9, 40)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_parameters_round_trip_and_every_one_gets_a_gradient(target):
  definition, params = _draft(target, 1)
  module = eagle_torch.TorchEagle(definition, params)
  tree = module.trained_tree()
  want = definition.trained(params)
  assert set(tree) == set(want) - {'head'}
  want_flat = trees.flatten(want)
  for path, value in trees.flatten(tree).items():
    np.testing.assert_array_equal(value, want_flat[path])
  tokens = torch.randint(0, 48, (2, 7))
  features = torch.randn(2, 7, definition.feature_dim)
  module.training_time_test(tokens, features, 2).logsumexp(-1).sum().backward()
  for name, parameter in module.named_parameters():
    assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
  assert not module.embedding.requires_grad and not module.head.requires_grad
  changed = jax.tree_util.tree_map(lambda x: x + 1.0, tree)
  module.load_trained_tree(changed)
  np.testing.assert_array_equal(module.trained_tree()['fuse']['kernel'],
                                changed['fuse']['kernel'])


def test_other_layer_kinds_are_refused(target):
  gemma = llama.random_model(vocab_size=48, embed_dim=32, num_layers=4, seed=4, family='gemma2')
  draft = eagle.random_draft(gemma, num_layers=1, head_size=40, feature_layers=(0, 1, 3))
  with pytest.raises(NotImplementedError, match='plain Llama'):
    eagle_torch.TorchEagle(draft.definition, draft.params)
  final = eagle.random_draft(target, num_layers=1, head_size=40)
  with pytest.raises(NotImplementedError, match='EAGLE-3'):
    eagle_torch.TorchEagle(final.definition, final.params)


def test_chunked_head_scores_and_their_gradient_equal_the_direct_computation():
  torch.manual_seed(0)
  hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
  head = torch.randn(8, 12, dtype=torch.float64)
  ids = torch.randint(0, 12, (2, 5, 3))
  normalizer, picked, argmax = eagle_torch.head_scores(hidden, head, ids, chunk=3)
  logits = hidden @ head
  torch.testing.assert_close(normalizer.double(), logits.logsumexp(-1), rtol=1e-6, atol=1e-6)
  torch.testing.assert_close(picked.double(), logits.gather(-1, ids), rtol=1e-6, atol=1e-6)
  assert torch.equal(argmax, logits.argmax(-1))
  w1, w2 = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
  got, = torch.autograd.grad((normalizer * w1).sum() + (picked * w2).sum(), hidden)
  want, = torch.autograd.grad((logits.logsumexp(-1) * w1).sum()
                              + (logits.gather(-1, ids) * w2).sum(), hidden)
  torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_token_loss_against_hand_computed_cross_entropies():
  logits = torch.tensor([[[2.0, 0.0, -1.0, 1.0], [0.5, 0.5, 0.5, 0.5]]])  # [1, 2, 4]
  labels = torch.tensor([[3, -1]])  # the second position's next token is outside the head
  soft_labels = torch.tensor([[[0, 3], [1, 2]]])
  soft_probs = torch.tensor([[[0.6, 0.3], [0.5, 0.0]]])
  mask = torch.tensor([[1.0, 1.0]])
  ids = torch.cat([labels.clamp(min=0)[..., None], soft_labels], -1)
  normalizer, picked, _ = eagle_torch.head_scores(logits, torch.eye(4), ids)
  log_q = torch.log_softmax(logits, -1)[0]
  hard = -log_q[0, 3]  # only the first position has a head label
  soft = (-(0.6 * log_q[0, 0] + 0.3 * log_q[0, 3]) - 0.5 * log_q[1, 1]) / 2
  got = eagle_torch.token_loss(normalizer, picked, labels, soft_probs, mask, soft_weight=0.7)
  torch.testing.assert_close(got, 0.7 * soft + 0.3 * hard)
  torch.testing.assert_close(
      eagle_torch.token_loss(normalizer, picked, labels, soft_probs, mask, soft_weight=0.0),
      hard)


def test_a_trainer_step_lowers_the_loss_on_its_batch(target):
  definition, params = _draft(target, 1)
  trainer = eagle_torch.Trainer(definition, params, steps=2, soft_weight=0.7, bfloat16=False)
  rng = np.random.default_rng(3)
  batch = (rng.integers(0, 48, (2, 8)), rng.standard_normal((2, 8, definition.feature_dim)),
           rng.integers(-1, 40, (2, 8)), rng.random((2, 8, 4)) / 4,
           rng.integers(0, 40, (2, 8, 4)), np.ones((2, 8)))
  losses = [trainer.step(1e-2, *batch)[0] for _ in range(5)]
  assert losses[-1] < losses[0]
