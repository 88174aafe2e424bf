"""A self-contained example: speculative vs plain decoding on small random Llama models.

    python -m speclm.example [--gamma=4] [--max_new_tokens=64] [--batch_size=4]

The target is a random 4-layer Llama; the draft is the target with noise added to its weights
(a stand-in for a distilled draft). No checkpoint or network is needed. It prints, for greedy
and temperature-1 sampling, the measured α, tokens per target call, both wall times and their
ratio, and whether the greedy outputs are identical.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

import speclm
from speclm.models import llama

_GAMMA = flags.DEFINE_integer('gamma', 4, 'Tokens drafted per target call.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens generated per prompt.')
_BATCH = flags.DEFINE_integer('batch_size', 4, 'Prompts decoded together.')
_NOISE = flags.DEFINE_float('draft_noise', 0.15, 'Relative weight noise of the draft.')


def noisy_copy(model: speclm.Model, scale: float, seed: int) -> speclm.Model:
  """The model with relative Gaussian noise on every weight: a related, imperfect draft."""
  leaves, tree = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  return speclm.Model(model.definition, jax.tree_util.tree_unflatten(tree, noisy))


def _timed(fn):
  fn()  # compile
  start = time.perf_counter()
  result = fn()
  jax.block_until_ready(result.tokens)
  return result, time.perf_counter() - start


def main(argv):
  """Decodes random prompts with a random 4-layer Llama target and a noisy copy as draft,
  greedy and at temperature 1, and prints α, tokens per target call and both times.
  """
  del argv
  target = llama.random_model(vocab_size=512, embed_dim=256, num_layers=4, seed=0,
                              num_heads=8, num_kv_heads=4)
  draft = noisy_copy(target, _NOISE.value, seed=1)
  rng = np.random.RandomState(0)
  lengths = rng.randint(4, 13, size=_BATCH.value)
  prompts = rng.randint(0, 512, size=(_BATCH.value, 12))
  print(f'target: 4-layer random Llama; draft: target + {_NOISE.value:.0%} weight noise;'
        f' batch {_BATCH.value}, {_MAX_NEW.value} new tokens, γ = {_GAMMA.value}')
  for sampling in (speclm.GREEDY, speclm.SamplingConfig(temperature=1.0)):
    kwargs = dict(sampling=sampling, max_new_tokens=_MAX_NEW.value, seed=0)
    base, base_time = _timed(lambda: speclm.autoregressive_decode(target, prompts, lengths,
                                                                  **kwargs))
    spec, spec_time = _timed(lambda: speclm.speculative_decode(
        target, draft, prompts, lengths, gamma=_GAMMA.value, **kwargs))
    line = (f'temperature {sampling.temperature:g}: α = {spec.stats.alpha:.3f},'
            f' {spec.tokens_per_target_call:.2f} tokens per target call,'
            f' baseline {base_time * 1e3:.0f} ms, speculative {spec_time * 1e3:.0f} ms,'
            f' speedup {base_time / spec_time:.2f}×')
    if sampling.is_greedy:
      line += f', identical outputs: {bool(np.array_equal(spec.tokens, base.tokens))}'
    print(line)
  print('first row, speculative:', spec.to_lists()[0][:16], '…')


if __name__ == '__main__':
  app.run(main)
