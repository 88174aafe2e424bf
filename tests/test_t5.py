"""T5 v1.0 / v1.1 (speclm.models.t5): parameter tree, cache, protocol, decoding, gin sizes."""

import dataclasses
import functools
import itertools
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import speclm
from speclm import sampling as sampling_lib
from speclm import trees
from speclm.models import t5

REPO = Path(__file__).resolve().parents[1]
GIN_DIR = REPO / 'configs' / 'models'


def _inputs():
  """Three right-padded encoder inputs of different lengths."""
  prompts = np.array([[5, 6, 7, 8, 9, 10, 1],
                      [11, 12, 1, 0, 0, 0, 0],
                      [13, 14, 15, 16, 1, 0, 0]], np.int32)
  return prompts, np.array([7, 3, 5], np.int32)


# ----------------------------------------------------------------------------------------------
# Parameter tree and sizes


def test_v1_1_tree_has_t5x_names_and_shapes():
  config = t5.tiny_config(vocab_size=40, emb_dim=8, num_heads=4, head_dim=3, mlp_dim=16)
  flat = trees.flatten(t5.T5(config).param_shapes())
  expected = {
      'token_embedder/embedding': (40, 8),
      'encoder/relpos_bias/rel_embedding': (4, 32),
      'decoder/relpos_bias/rel_embedding': (4, 32),
      'encoder/layers_0/attention/query/kernel': (8, 12),
      'encoder/layers_0/attention/out/kernel': (12, 8),
      'encoder/layers_1/pre_attention_layer_norm/scale': (8,),
      'encoder/layers_0/mlp/wi_0/kernel': (8, 16),
      'encoder/layers_0/mlp/wi_1/kernel': (8, 16),
      'encoder/layers_0/mlp/wo/kernel': (16, 8),
      'encoder/layers_0/pre_mlp_layer_norm/scale': (8,),
      'encoder/encoder_norm/scale': (8,),
      'decoder/layers_1/self_attention/key/kernel': (8, 12),
      'decoder/layers_0/encoder_decoder_attention/value/kernel': (8, 12),
      'decoder/layers_0/pre_self_attention_layer_norm/scale': (8,),
      'decoder/layers_0/pre_cross_attention_layer_norm/scale': (8,),
      'decoder/decoder_norm/scale': (8,),
      'decoder/logits_dense/kernel': (8, 40),
  }
  for name, shape in expected.items():
    assert flat[name].shape == shape, name
  assert len(flat) == 1 + 2 + 2 + 2 * 9 + 2 * 14 + 1  # embed, norms, relpos, layers, logits


def test_v1_0_tree_has_relu_mlp_and_no_logits_dense():
  flat = trees.flatten(t5.T5(t5.tiny_config(version='1.0')).param_shapes())
  assert 'encoder/layers_0/mlp/wi/kernel' in flat
  assert not any('wi_0' in name for name in flat)
  assert 'decoder/logits_dense/kernel' not in flat


def test_logical_axes_cover_every_parameter():
  definition = t5.T5(t5.tiny_config())
  axes = trees.flatten(definition.logical_axes())
  shapes = trees.flatten(definition.param_shapes())
  assert set(axes) == set(shapes)
  for name, shape in shapes.items():
    assert len(axes[name]) == len(shape.shape), name
  assert axes['encoder/layers_0/attention/out/kernel'] == ('joined_kv', 'embed')
  assert axes['decoder/layers_1/mlp/wi_1/kernel'] == ('embed', 'mlp')
  assert axes['token_embedder/embedding'] == ('vocab', 'embed')


def gin_t5_config():
  """`T5Config` as gin configures it, under the name the gin files use.

  `speclm.models.t5` imports no gin: the job layer (speclm.run) registers the dataclass with
  `gin.external_configurable`. Registering the same class again is allowed, so this works
  whether or not the job layer has been imported.
  """
  try:
    return gin.get_configurable('speclm.models.t5.T5Config')
  except ValueError:  # not registered yet
    return gin.external_configurable(t5.T5Config, module='speclm.models.t5')


def _gin_config(path: Path) -> t5.T5Config:
  config_class = gin_t5_config()
  gin.clear_config()
  gin.parse_config_file(str(path))
  try:
    with gin.config_scope(f'{path.parent.name}_{path.stem.lower()}'):
      return config_class()
  finally:
    gin.clear_config()


def _count_from_shapes(c: t5.T5Config) -> int:
  """Parameters of a T5 written out from its shapes, independently of the module."""
  d, inner, f = c.emb_dim, c.num_heads * c.head_dim, c.mlp_dim
  attention = 4 * d * inner
  mlp = (len(c.mlp_activations) + 1) * d * f
  encoder_layer = attention + mlp + 2 * d
  decoder_layer = 2 * attention + mlp + 3 * d
  relpos = 2 * c.num_heads * c.relative_attention_num_buckets
  logits = 0 if c.logits_via_embedding else d * c.vocab_size
  return (c.vocab_size * d + c.num_encoder_layers * encoder_layer
          + c.num_decoder_layers * decoder_layer + relpos + 2 * d + logits)


GIN_SIZES = {
    't5_1_1/tiny.gin': (8, 4, 3, 2, 2, 16, '1.1'),
    't5_1_1/small.gin': (512, 6, 64, 8, 8, 1024, '1.1'),
    't5_1_1/base.gin': (768, 12, 64, 12, 12, 2048, '1.1'),
    't5_1_1/large.gin': (1024, 16, 64, 24, 24, 2816, '1.1'),
    't5_1_1/xl.gin': (2048, 32, 64, 24, 24, 5120, '1.1'),
    't5_1_1/xxl.gin': (4096, 64, 64, 24, 24, 10240, '1.1'),
    't5_1_0/small.gin': (512, 8, 64, 6, 6, 2048, '1.0'),
    't5_1_0/base.gin': (768, 12, 64, 12, 12, 3072, '1.0'),
    't5_1_0/large.gin': (1024, 16, 64, 24, 24, 4096, '1.0'),
    't5_1_0/3B.gin': (1024, 32, 128, 24, 24, 16384, '1.0'),
    't5_1_0/11B.gin': (1024, 128, 128, 24, 24, 65536, '1.0'),
}
# Published sizes: the two T5 1.1 numbers and the original T5 releases.
KNOWN_COUNTS = {
    't5_1_1/small.gin': 76_961_152,
    't5_1_1/xxl.gin': 11_135_332_352,
    't5_1_0/small.gin': 60_506_624,
    't5_1_0/base.gin': 222_903_552,
    't5_1_0/large.gin': 737_668_096,
    't5_1_0/3B.gin': 2_851_598_336,
    't5_1_0/11B.gin': 11_307_321_344,
}


def test_every_t5_gin_file_is_listed():
  found = {str(p.relative_to(GIN_DIR)) for p in GIN_DIR.glob('t5_1_*/*.gin')}
  assert found == set(GIN_SIZES)


@pytest.mark.parametrize('name', sorted(GIN_SIZES))
def test_gin_sizes_and_parameter_counts(name):
  config = _gin_config(GIN_DIR / name)
  d, n, h, enc, dec, f, version = GIN_SIZES[name]
  assert (config.emb_dim, config.num_heads, config.head_dim, config.num_encoder_layers,
          config.num_decoder_layers, config.mlp_dim) == (d, n, h, enc, dec, f)
  assert config.version == version
  assert config.vocab_size == 32128
  assert (config.pad_id, config.eos_id, config.decoder_start_token_id) == (0, 1, 0)
  assert config.vocabulary_path == (
      'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model')
  count = t5.count_params(config)  # jax.eval_shape: nothing is allocated
  assert count == _count_from_shapes(config)
  if name in KNOWN_COUNTS:
    assert count == KNOWN_COUNTS[name]


def test_gin_scopes_let_target_and_draft_coexist():
  config_class = gin_t5_config()
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(
        [str(GIN_DIR / 't5_1_1/xxl.gin'), str(GIN_DIR / 't5_1_1/small.gin')],
        ["T5Config.vocabulary_path = '/data/spm.model'", "t5_1_1_small/T5Config.dtype = 'float32'"])
    with gin.config_scope('t5_1_1_xxl'):
      xxl = config_class()
    with gin.config_scope('t5_1_1_small'):
      small = config_class()
  finally:
    gin.clear_config()
  assert (xxl.emb_dim, small.emb_dim) == (4096, 512)
  assert (xxl.dtype, small.dtype) == ('bfloat16', 'float32')
  assert xxl.vocabulary_path == small.vocabulary_path == '/data/spm.model'
  assert type(xxl) is t5.T5Config  # the plain dataclass: gin only supplies its arguments


def test_config_validation():
  with pytest.raises(ValueError, match='mlp_activations'):
    t5.T5Config(mlp_activations=('swish-ish',))
  with pytest.raises(ValueError, match='num_heads'):
    t5.T5Config(num_heads=0)
  with pytest.raises(ValueError, match='dtype'):
    t5.T5Config(dtype='float33')


def test_validate_params_names_parameter_and_shapes():
  definition = t5.T5(t5.tiny_config())
  params = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype),
                                  definition.param_shapes())
  definition.validate_params(params)
  params['encoder']['layers_0']['mlp']['wo']['kernel'] = np.zeros((3, 3))
  with pytest.raises(ValueError, match=r'encoder/layers_0/mlp/wo/kernel.*\(3, 3\).*\(32, 16\)'):
    definition.validate_params(params)
  del params['decoder']['decoder_norm']
  with pytest.raises(ValueError, match='missing.*decoder/decoder_norm/scale'):
    definition.validate_params(params)


def test_relative_position_buckets():
  rel = np.arange(-200, 201)
  causal = t5.relative_position_bucket(rel, bidirectional=False, num_buckets=32,
                                       max_distance=128)
  assert np.all(causal[rel >= 0] == 0)  # the future is one bucket (masked anyway)
  assert list(causal[200 - 15:201][::-1]) == list(range(16))  # exact up to 15 back
  assert causal[0] == 31 and causal.max() == 31
  both = t5.relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
  assert both[200] == 0 and both[201] == 17 and both[199] == 1
  assert both.max() == 31 and set(np.unique(both)) <= set(range(32))
  # The jnp path (used inside the decoder with per-row positions) agrees with numpy.
  np.testing.assert_array_equal(
      t5.relative_position_bucket(jnp.asarray(rel), bidirectional=True, num_buckets=32,
                                  max_distance=128), both)


# ----------------------------------------------------------------------------------------------
# Cache and protocol


@pytest.fixture(scope='module')
def small():
  """A v1.1 T5 for the cache tests (its compiled functions are reused across tests)."""
  return t5.random_model(vocab_size=48, emb_dim=16, seed=3)


# Jitted protocol calls shared by the tests below, so equal shapes compile once per process.
_prefill = jax.jit(lambda d, *args: d.prefill(*args), static_argnums=0)
_extend = jax.jit(lambda d, *args: d.extend(*args), static_argnums=0)

DECODER_TOKENS = np.array([[0, 3, 4, 5, 6, 7, 8, 9],
                           [0, 10, 11, 12, 13, 14, 15, 16],
                           [0, 17, 18, 19, 20, 21, 22, 23]], np.int32)


@pytest.mark.parametrize('version, use_jit', [('1.0', True), ('1.1', True), ('1.1', False)])
def test_cached_k_token_extends_equal_teacher_forced_forward(small, version, use_jit):
  model = small if version == '1.1' else t5.random_model(vocab_size=48, emb_dim=16, seed=3,
                                                         version=version)
  d, params = model.definition, model.params
  prompts, lengths = _inputs()
  full = d.forward(params, prompts, lengths, DECODER_TOKENS)
  # Eager mode compiles every primitive per shape, so only `extend` runs un-jitted there.
  prefill = functools.partial(_prefill, d)
  extend = functools.partial(_extend, d) if use_jit else d.extend
  cache = d.init_cache(3, 12)
  first, cache = prefill(params, prompts, lengths, cache)
  assert cache.lengths.tolist() == [1, 1, 1] and cache.capacity == 12
  assert d.prefix_length(7) == 1
  assert d.last_prefix_token(prompts, lengths).tolist() == [0, 0, 0]
  np.testing.assert_allclose(first, full[:, 0], atol=1e-5)
  pieces, start = [], 1
  for k in ((3, 1, 3) if use_jit else (3, 4)):
    logits, cache = extend(params, DECODER_TOKENS[:, start:start + k], cache)
    pieces.append(logits)
    start += k
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full[:, 1:], atol=1e-5)
  assert cache.lengths.tolist() == [8, 8, 8]


def test_per_row_positions_and_rollback(small):
  """Rows at different lengths extend independently; rolled-back entries are never read."""
  d, params = small.definition, small.params
  prompts, lengths = _inputs()
  full = d.forward(params, prompts, lengths, DECODER_TOKENS)
  cache = d.init_cache(3, 12)
  _, cache = _prefill(d, params, prompts, lengths, cache)
  # Three true tokens, then garbage drafts; roll every row back to a different length.
  _, cache = _extend(d, params, DECODER_TOKENS[:, 1:4], cache)
  _, cache = _extend(d, params, np.full((3, 3), 30, np.int32), cache)
  keep = np.array([1, 2, 4], np.int32)
  cache = d.rollback(cache, jnp.asarray(keep))
  # Re-feed each row's true tokens from its own position: one K=3 call at per-row offsets.
  tokens = np.stack([DECODER_TOKENS[b, keep[b]:keep[b] + 3] for b in range(3)])
  logits, cache = _extend(d, params, tokens, cache)
  for b in range(3):
    np.testing.assert_allclose(logits[b], full[b, keep[b]:keep[b] + 3], atol=1e-5)
  assert cache.lengths.tolist() == (keep + 3).tolist()


def test_encoder_ignores_padding(small):
  d, params = small.definition, small.params
  prompts, lengths = _inputs()
  other = np.where(np.arange(7)[None] < lengths[:, None], prompts, 33).astype(np.int32)
  wider = np.concatenate([prompts, np.full((3, 4), 21, np.int32)], axis=1)
  ref = d.forward(params, prompts, lengths, DECODER_TOKENS)
  np.testing.assert_allclose(d.forward(params, other, lengths, DECODER_TOKENS), ref, atol=1e-5)
  np.testing.assert_allclose(d.forward(params, wider, lengths, DECODER_TOKENS), ref, atol=1e-5)


def test_bfloat16_params_and_activations(small):
  config = dataclasses.replace(small.definition.config, dtype='bfloat16', param_dtype='bfloat16')
  definition = t5.T5(config)
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), small.params)
  definition.validate_params(params)
  prompts, lengths = _inputs()
  logits = definition.forward(params, prompts, lengths, DECODER_TOKENS)
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))
  assert definition.init_cache(3, 4).keys.dtype == jnp.bfloat16
  reference = small.definition.forward(small.params, prompts, lengths, DECODER_TOKENS)
  assert np.max(np.abs(logits - reference)) < 0.1 * np.max(np.abs(reference))


# ----------------------------------------------------------------------------------------------
# Decoding with T5 target and T5 drafts


@pytest.fixture(scope='module')
def target():
  return t5.random_model(vocab_size=64, emb_dim=32, seed=1)


def _noisy_copy(model, scale, seed):
  leaves, treedef = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return speclm.Model(model.definition, jax.tree_util.tree_unflatten(treedef, noisy))


def test_greedy_speculative_equals_autoregressive(target):
  prompts, lengths = _inputs()
  baseline = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=14)
  assert len({t for row in baseline.to_lists() for t in row}) > 5  # not a degenerate model
  # Same definition, so both drafts share one compiled loop (params are arguments).
  drafts = {
      'related': _noisy_copy(target, 0.3, seed=7),
      'unrelated': speclm.Model(target.definition, target.definition.init_params(
          jax.random.key(8))),
  }
  alphas = {}
  for name, draft in drafts.items():
    out = speclm.speculative_decode(target, draft, prompts, lengths, gamma=3,
                                    max_new_tokens=14)
    assert out.to_lists() == baseline.to_lists(), name
    assert out.lengths.tolist() == [14, 14, 14]
    alphas[name] = out.stats.alpha
  assert alphas['related'] > alphas['unrelated']
  assert int(out.stats.target_calls) <= 15


def _exact_sequence_distribution(model, prompt, length, config, num_tokens):
  """P(x_1 … x_n) for every sequence over the vocabulary, from teacher-forced logits."""
  vocab = model.vocab_size
  prefixes = np.array(list(itertools.product(range(vocab), repeat=num_tokens - 1)), np.int32)
  decoder = np.concatenate([np.zeros((len(prefixes), 1), np.int32), prefixes], axis=1)
  logits = model.definition.forward(
      model.params, np.repeat(prompt[None], len(prefixes), 0),
      np.full((len(prefixes),), length, np.int32), decoder)
  probs = np.asarray(sampling_lib.standardize(logits, config), np.float64)  # [N, n, V]
  joint = np.zeros((vocab,) * num_tokens)
  for row, prefix in enumerate(prefixes):
    p = probs[row, 0, prefix[0]]
    for i in range(1, num_tokens - 1):
      p *= probs[row, i, prefix[i]]
    joint[tuple(prefix)] = p * probs[row, -1]
  return joint.reshape(-1)


@pytest.mark.parametrize('config', [
    speclm.SamplingConfig(temperature=1.0),
    speclm.SamplingConfig(temperature=0.7, top_k=4, top_p=0.9),
], ids=['t1', 't0.7_k4_p0.9'])
def test_speculative_sampling_matches_exact_distribution(config):
  """Goodness of fit over all 6^3 continuations: chi-square at significance 0.001."""
  vocab, num_tokens, samples = 6, 3, 24_000
  target = t5.random_model(vocab_size=vocab, emb_dim=16, seed=11)  # v1.1
  draft = t5.random_model(vocab_size=vocab, emb_dim=8, num_layers=1, seed=12, version='1.0')
  prompt, length = np.array([2, 3, 4, 1], np.int32), 4
  expected = _exact_sequence_distribution(target, prompt, length, config, num_tokens)
  assert abs(expected.sum() - 1) < 1e-6
  out = speclm.speculative_decode(
      target, draft, np.repeat(prompt[None], samples, 0), np.full((samples,), length, np.int32),
      gamma=2, sampling=config, max_new_tokens=num_tokens, seed=2024)
  assert np.all(np.asarray(out.lengths) == num_tokens)
  tokens = np.asarray(out.tokens)
  index = np.ravel_multi_index(tokens.T, (vocab,) * num_tokens)
  observed = np.bincount(index, minlength=vocab ** num_tokens).astype(np.float64)
  assert observed[expected == 0].sum() == 0  # never a sequence the target forbids
  # Pool cells with expected count < 5 (standard validity condition of the chi-square test).
  exp_counts = expected * samples
  small = (exp_counts < 5) & (exp_counts > 0)
  big = exp_counts >= 5
  f_obs = np.append(observed[big], observed[small].sum())
  f_exp = np.append(exp_counts[big], exp_counts[small].sum())
  if f_exp[-1] == 0:
    f_obs, f_exp = f_obs[:-1], f_exp[:-1]
  f_exp *= f_obs.sum() / f_exp.sum()
  result = stats.chisquare(f_obs, f_exp)
  assert result.pvalue > 1e-3, (result, len(f_obs))
  assert 0 < out.stats.alpha < 1
