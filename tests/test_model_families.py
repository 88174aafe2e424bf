"""Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 from Hugging Face directories (issue 23).

For each family a small random model is built in HF transformers (float32), saved with
`save_pretrained` and read by `speclm.checkpoints.hf_llama.load_model`. Then, per family:
  * a padded batch (rows of different lengths) prefilled and extended by K tokens gives the
    logits HF computes for each row alone, within 1e-4;
  * greedy HF `generate()` equals `autoregressive_decode` token for token;
  * greedy speculative decoding with a smaller random draft of the same family (also saved by
    HF and loaded) equals the baseline; so does the tree loop with a branchy tree.
Sliding windows are set shorter than the sequences, so the masks matter; Gemma 3 also gets a
linear RoPE scaling on its global layers and a final soft-cap.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm import decoding
from speclm import token_trees
from speclm import tree_decoding
from speclm.checkpoints import hf_llama
from speclm.models import llama

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

TOLERANCE = 1e-4
VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
             max_position_embeddings=256)
DRAFT_SIZES = dict(SIZES, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)
# family -> (HF class, HF config class, settings beyond the sizes)
FAMILIES = {
    'mistral': ('MistralForCausalLM', 'MistralConfig', dict(sliding_window=6)),
    'qwen2': ('Qwen2ForCausalLM', 'Qwen2Config', dict(rope_theta=500.0)),
    'qwen3': ('Qwen3ForCausalLM', 'Qwen3Config', dict(tie_word_embeddings=True)),
    'gemma2': ('Gemma2ForCausalLM', 'Gemma2Config',
               dict(sliding_window=6, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                    final_logit_softcapping=8.0)),
    'gemma3': ('Gemma3ForCausalLM', 'Gemma3TextConfig',
               dict(sliding_window=6, query_pre_attn_scalar=12, sliding_window_pattern=2,
                    final_logit_softcapping=8.0,
                    rope_scaling=dict(rope_type='linear', factor=2.0))),
}


def _save(directory, family, sizes, seed):
  """A random HF model of `family` saved to `directory`; returns it (float32, eval)."""
  class_name, config_name, settings = FAMILIES[family]
  config = getattr(transformers, config_name)(**sizes, **settings)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access  # Gemma's soft-cap
  torch.manual_seed(seed)
  model = getattr(transformers, class_name)(config).float().eval()
  with torch.no_grad():  # the default init is tiny; make every weight matter
    for param in model.parameters():
      param.normal_(0.0, 0.2)
  model.save_pretrained(directory, safe_serialization=True)
  return model


@pytest.fixture(scope='module', params=sorted(FAMILIES))
def family_models(request, tmp_path_factory):
  """(family, HF target, our target, our draft) for each family."""
  family = request.param
  root = tmp_path_factory.mktemp(family)
  hf_target = _save(root / 'target', family, SIZES, seed=0)
  _save(root / 'draft', family, DRAFT_SIZES, seed=1)
  target = hf_llama.load_model(root / 'target')
  draft = hf_llama.load_model(root / 'draft')
  return family, hf_target, target, draft


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _prompts():
  rng = np.random.default_rng(4)
  lengths = np.array([9, 4, 7], np.int32)
  prompts = rng.integers(1, VOCAB, size=(3, 9)).astype(np.int32)
  prompts[np.arange(9)[None, :] >= lengths[:, None]] = 0  # right padding
  return prompts, lengths


def test_config_has_the_family_switches(family_models):
  family, _, target, _ = family_models
  c = target.definition.config
  assert c.family == family
  assert c.qkv_bias == (family == 'qwen2')
  assert c.qk_norm == (family in ('qwen3', 'gemma3'))
  assert c.post_norms == c.scale_embeddings == (family in ('gemma2', 'gemma3'))
  assert c.sliding_window == (None if family.startswith('qwen') else 6)
  if family in ('gemma2', 'gemma3'):
    assert c.layer_types == ('sliding', 'full')
    assert c.activation == 'gelu_tanh' and c.norm_offset == 1.0
  if family == 'gemma3':
    assert c.local_rope_theta == 10_000.0 and c.rope_scaling.factor == 2.0


def test_padded_batch_logits_match_hugging_face(family_models):
  """Prefill of rows of different lengths, then a 5-token extend: HF's logits per row."""
  _, hf_model, target, _ = family_models
  definition, params = target.definition, target.params
  prompts, lengths = _prompts()
  rng = np.random.default_rng(5)
  new = rng.integers(1, VOCAB, size=(3, 5)).astype(np.int32)
  cache = definition.init_cache(3, 16)
  last, cache = jax.jit(definition.prefill)(params, jnp.asarray(prompts), jnp.asarray(lengths),
                                            cache)
  logits, _ = jax.jit(definition.extend)(params, jnp.asarray(new), cache)
  for b in range(3):
    row = np.concatenate([prompts[b, :lengths[b]], new[b]])[None]
    reference = _hf_logits(hf_model, row)[0]
    np.testing.assert_allclose(np.asarray(last[b]), reference[lengths[b] - 1], atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(logits[b]), reference[lengths[b]:], atol=TOLERANCE)


LIMITS = np.array([12, 7, 10], np.int32)  # new tokens per row


@pytest.fixture(scope='module')
def baseline(family_models):
  """Greedy `autoregressive_decode` of the padded batch, per-row limits."""
  _, _, target, _ = family_models
  return decoding.autoregressive_decode(target, *_prompts(), max_new_tokens=LIMITS)


def test_greedy_generation_matches_hugging_face(family_models, baseline):
  _, hf_model, _, _ = family_models
  prompts, lengths = _prompts()
  for b, row in enumerate(baseline.to_lists()):
    with torch.no_grad():
      out = hf_model.generate(torch.tensor(prompts[b:b + 1, :lengths[b]], dtype=torch.long),
                              max_new_tokens=int(LIMITS[b]), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    assert row == out[0, lengths[b]:].tolist()


@pytest.mark.slow
def test_speculative_decoding_equals_the_baseline(family_models, baseline):
  """A smaller random draft of the same family: the baseline's tokens. For Gemma 3 also the
  tree loop (tree nodes sit at positions that differ from their cache slots: the sliding
  window compares positions)."""
  family, _, target, draft = family_models
  prompts, lengths = _prompts()
  limits = LIMITS
  chain = decoding.speculative_decode(target, draft, prompts, lengths, gamma=3,
                                      max_new_tokens=limits)
  assert chain.to_lists() == baseline.to_lists()
  if family != 'gemma3':
    return
  shape = token_trees.TreeShape.from_branching((2, 2, 1))
  tree = tree_decoding.tree_speculative_decode(target, draft, prompts, lengths, tree=shape,
                                               max_new_tokens=limits)
  assert tree.to_lists() == baseline.to_lists()


def test_cpu_kernel_path_gives_the_same_logits(family_models):
  """`pack_for_cpu` (biases, q/k norms, soft-caps on top of the packed products)."""
  _, _, target, _ = family_models
  packed = llama.pack_for_cpu(target)
  if packed is target:
    pytest.skip('the CPU kernel is not available here')
  tokens = jnp.asarray(_prompts()[0])
  np.testing.assert_allclose(np.asarray(packed.definition.forward(packed.params, tokens)),
                             np.asarray(target.definition.forward(target.params, tokens)),
                             atol=TOLERANCE)


def test_export_to_transformers_round_trips(family_models):
  """ours -> HF's class of the family: the same logits."""
  _, hf_model, target, _ = family_models
  exported = hf_llama.to_transformers(target)
  assert type(exported) is type(hf_model)
  tokens = _prompts()[0][:1]
  np.testing.assert_allclose(_hf_logits(exported, tokens), _hf_logits(hf_model, tokens),
                             atol=1e-5)


def test_the_shard_by_shard_reader_reads_the_same_parameters(family_models, tmp_path):
  """`sharded.load_hf_llama_sharded` (the sharded jobs' reader) maps every family's tensors,
  biases and q/k norms included, as `load_model` does."""
  from speclm import partitioning  # pylint: disable=import-outside-toplevel
  from speclm import trees  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import sharded  # pylint: disable=import-outside-toplevel
  _, hf_model, target, _ = family_models
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  got = sharded.load_hf_llama_sharded(tmp_path, partitioning.Partitioner(num_partitions=1))
  want = trees.flatten(target.params)
  assert sorted(trees.flatten(got.params)) == sorted(want)
  for name, value in trees.flatten(got.params).items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want[name]), err_msg=name)


def test_sliding_window_masks_only_the_sliding_layers():
  """A token beyond the window changes a global layer's output, not a lone sliding layer's."""
  def model(layer_types):
    return llama.random_model(vocab_size=32, num_layers=1, family='gemma3', sliding_window=3,
                              layer_types=layer_types, seed=2)
  tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]])
  changed = tokens.at[0, 0].set(11)  # 5 positions before the last one: outside a window of 3
  for kinds, differs in ((('sliding',), False), (('full',), True)):
    m = model(kinds)
    forward = jax.jit(m.definition.forward)
    last = lambda t, m=m, forward=forward: np.asarray(forward(m.params, t))[0, -1]
    assert (np.max(np.abs(last(tokens) - last(changed))) > 1e-6) == differs, kinds


def test_unsupported_configs_are_refused():
  base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2)
  with pytest.raises(ValueError, match='gemma2.*qwen3|llama.*mistral'):
    hf_llama.config_from_hf({'model_type': 'phi3', **base})
  with pytest.raises(ValueError, match='gelu_pytorch_tanh'):
    hf_llama.config_from_hf({'model_type': 'qwen2', 'hidden_act': 'relu', **base})
  with pytest.raises(ValueError, match='bidirectional'):
    hf_llama.config_from_hf({'model_type': 'gemma3_text', 'use_bidirectional_attention': True,
                             **base})
  with pytest.raises(ValueError, match='Unknown model family'):
    llama.family_config('phi', vocab_size=8, num_layers=1, embed_dim=8, num_heads=2,
                        num_kv_heads=2, head_dim=4, mlp_dim=8)
  with pytest.raises(ValueError, match='sliding_window is not set'):
    dataclasses.replace(llama.random_model().definition.config, layer_types=('sliding', 'full'))


def test_multimodal_gemma3_directory_loads_its_language_model(tmp_path):
  """model_type 'gemma3' with a text_config and weights under model.language_model."""
  import json  # pylint: disable=import-outside-toplevel
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  hf_model = _save(tmp_path / 'text', 'gemma3', SIZES, seed=3)
  text_config = json.loads((tmp_path / 'text' / 'config.json').read_text())
  weights = st_numpy.load_file(str(tmp_path / 'text' / 'model.safetensors'))
  weights = {k.replace('model.', 'model.language_model.', 1): v for k, v in weights.items()}
  weights['model.vision_tower.vision_model.post_layernorm.weight'] = np.ones(4, np.float32)
  (tmp_path / 'mm').mkdir()
  st_numpy.save_file(weights, str(tmp_path / 'mm' / 'model.safetensors'))
  (tmp_path / 'mm' / 'config.json').write_text(json.dumps(
      {'model_type': 'gemma3', 'architectures': ['Gemma3ForConditionalGeneration'],
       'text_config': text_config, 'vision_config': {}}))
  model = hf_llama.load_model(tmp_path / 'mm')
  tokens = _prompts()[0][:1]
  np.testing.assert_allclose(np.asarray(model.definition.forward(model.params,
                                                                 jnp.asarray(tokens))),
                             _hf_logits(hf_model, tokens), atol=TOLERANCE)
