"""speclm.kernels.cache_attention: the decode steps' attention over the stacked cache, in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm.kernels import cache_attention
from speclm.kernels import cpu_matmul
from speclm.models import attention
from speclm.models import llama

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason='no CPU kernel here')


def _inputs(batch=2, queries=5, kv_heads=2, groups=3, head_dim=32, slots=37, layers=3, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, queries, kv_heads, groups, head_dim)).astype(np.float32)
  keys = rng.standard_normal((layers, batch, kv_heads, slots, head_dim)).astype(np.float32)
  values = rng.standard_normal((layers, batch, kv_heads, slots, head_dim)).astype(np.float32)
  visible = rng.random((batch, queries, slots)) < 0.4  # scattered, as a token tree's
  visible[:, :, 0] = True  # every query sees at least one slot
  visible[0, 0, :] = False  # and one sees a single slot at the end
  visible[0, 0, slots - 1] = True
  return q, keys, values, visible


@pytest.mark.parametrize('cap', [None, 2.0])
def test_equals_xla_attention_over_the_layer(cap):
  q, keys, values, visible = _inputs()
  for layer in range(keys.shape[0]):
    got = cache_attention.attend(q, keys, values, visible, layer=layer, scale=0.3, cap=cap)
    want = attention.attend(q, keys[layer], values[layer], jnp.asarray(visible), scale=0.3,
                            cap=cap, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_a_query_gets_the_same_numbers_alone_or_with_others():
  q, keys, values, visible = _inputs(batch=3, queries=5)
  together = np.asarray(cache_attention.attend(q, keys, values, visible, layer=1, scale=0.2,
                                               cap=None))
  for b in range(3):
    for k in range(5):
      alone = cache_attention.attend(q[b:b + 1, k:k + 1], keys[:, b:b + 1], values[:, b:b + 1],
                                     visible[b:b + 1, k:k + 1], layer=1, scale=0.2, cap=None)
      np.testing.assert_array_equal(np.asarray(alone)[0, 0], together[b, k])


def test_a_query_that_sees_no_slot_gets_zeros_and_changes_no_other_query():
  """What `LlamaModule`'s `live` relies on: a position not needed sees nothing, attends to
  nothing (exactly 0, as its weights would all be) and is skipped."""
  q, keys, values, visible = _inputs(batch=2, queries=5)
  dead = visible.copy()
  dead[0, 2:] = False
  dead[1, 4] = False
  got = np.asarray(cache_attention.attend(q, keys, values, dead, layer=2, scale=0.2, cap=None))
  assert not got[0, 2:].any() and not got[1, 4].any()
  for b, k in ((0, 0), (0, 1), (1, 0), (1, 3)):
    alone = cache_attention.attend(q[b:b + 1, k:k + 1], keys[:, b:b + 1], values[:, b:b + 1],
                                   visible[b:b + 1, k:k + 1], layer=2, scale=0.2, cap=None)
    np.testing.assert_array_equal(np.asarray(alone)[0, 0], got[b, k])


def test_bad_shapes_say_what_is_expected():
  q, keys, values, visible = _inputs()
  with pytest.raises(Exception, match='cache_attention: expects'):
    jax.block_until_ready(cache_attention.attend(q, keys, values, visible, layer=3, scale=1.0,
                                                 cap=None))


def test_packed_decode_steps_attend_through_the_kernel_and_match_the_plain_model():
  target = llama.random_model(vocab_size=120, embed_dim=64, num_layers=2, seed=4, mlp_dim=128,
                              num_heads=4, num_kv_heads=2)
  packed = llama.pack_for_cpu(target)
  tokens = jnp.asarray([[3, 4, 5, 6, 7, 8]], jnp.int32)

  def steps(model):
    definition = model.definition
    cache = definition.init_cache(1, 16)
    _, cache = jax.jit(definition.extend)(model.params, tokens[:, :3], cache)
    one, _ = jax.jit(definition.extend)(model.params, tokens[:, 3:], cache)
    return one, jax.make_jaxpr(definition.extend)(model.params, tokens[:, 3:], cache)

  got, jaxpr = steps(packed)
  want, plain_jaxpr = steps(target)
  assert cpu_matmul.CACHE_ATTENTION_TARGET in str(jaxpr)
  assert cpu_matmul.CACHE_ATTENTION_TARGET not in str(plain_jaxpr)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_heads_the_kernel_does_not_take_stay_with_xla():
  assert cache_attention.serves(64, jnp.float32) and cache_attention.serves(256, jnp.float32)
  assert not cache_attention.serves(8, jnp.float32)  # not a multiple of 16
  assert not cache_attention.serves(64, jnp.bfloat16)
  target = llama.random_model(vocab_size=120, embed_dim=32, num_layers=1, seed=4, num_heads=4)
  packed = llama.pack_for_cpu(target)  # head_dim 8
  cache = packed.definition.init_cache(1, 8)
  jaxpr = jax.make_jaxpr(packed.definition.extend)(packed.params, jnp.zeros((1, 1), jnp.int32),
                                                   cache)
  assert cpu_matmul.CACHE_ATTENTION_TARGET not in str(jaxpr)


def test_compare_script_times_a_revision_against_the_working_tree(tmp_path):
  """scripts/compare_cache_attention.py at its smallest: the kernel at HEAD and the working
  tree's, compiled alone, interleaved, their outputs compared bit for bit."""
  import os  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if shutil.which('git') is None or not os.path.exists(os.path.join(repo, '.git')):
    pytest.skip('needs a git checkout')
  proc = subprocess.run(
      [sys.executable, os.path.join(repo, 'scripts', 'compare_cache_attention.py'),
       '--old=HEAD', '--visible=40', '--queries=1,4', '--calls=2'],
      cwd=repo, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', '')))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith('| 40 |')]
  assert [row.split('|')[2].strip() for row in rows] == ['1', '4']
  # HEAD's kernel and the working tree's give the same numbers (today they are one source;
  # a kernel change that alters a query's sums shows up here as DIFFER).
  assert all(row.rstrip(' |').endswith('identical') for row in rows), proc.stdout
