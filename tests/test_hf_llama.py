"""The Hugging Face Llama reader: our logits equal `LlamaForCausalLM`'s on the same weights."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm.checkpoints import hf_llama
from speclm.models import llama

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

TOLERANCE = 1e-4


def _save_random_hf_llama(directory, *, seed=0, **overrides):
  """A random small HF Llama saved as safetensors; returns the torch model (float32, eval)."""
  settings = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
                  rope_theta=500.0, max_position_embeddings=256, tie_word_embeddings=False)
  settings.update(overrides)
  config = transformers.LlamaConfig(**settings)
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).float().eval()
  with torch.no_grad():  # the default init is tiny; make every weight matter
    for param in model.parameters():
      param.normal_(0.0, 0.2)
  model.save_pretrained(directory, safe_serialization=True)
  return model


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


CASES = {
    'untied_gqa': {},
    'tied': dict(tie_word_embeddings=True),
    'mha_head_dim': dict(num_key_value_heads=6, head_dim=12),
    'llama3_rope': dict(rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=16)),
    'linear_rope': dict(rope_scaling=dict(rope_type='linear', factor=4.0)),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_logits_match_hugging_face(tmp_path, case):
  hf_model = _save_random_hf_llama(tmp_path, **CASES[case])
  model = hf_llama.load_model(tmp_path)
  assert model.definition.config.tie_embeddings == (case == 'tied')
  assert model.definition.max_context_length == 256  # config.json's max_position_embeddings
  tokens = np.random.default_rng(1).integers(0, 97, size=(3, 40))
  ours = np.asarray(model.definition.forward(model.params, jnp.asarray(tokens, jnp.int32)))
  theirs = _hf_logits(hf_model, tokens)
  assert np.max(np.abs(ours - theirs)) < TOLERANCE


def test_cached_decoding_of_ragged_batch_matches_hugging_face(tmp_path):
  """Prefill of prompts of different lengths, then K-token extends, equal HF per row."""
  hf_model = _save_random_hf_llama(tmp_path, seed=3)
  model = hf_llama.load_model(tmp_path)
  definition, params = model.definition, model.params
  rng = np.random.default_rng(2)
  full = rng.integers(0, 97, size=(2, 20))
  lengths = np.array([5, 9])
  prompts = np.where(np.arange(12)[None] < lengths[:, None], full[:, :12], 0)
  cache = definition.init_cache(2, 24)
  last, cache = jax.jit(definition.prefill)(params, jnp.asarray(prompts, jnp.int32),
                                            jnp.asarray(lengths, jnp.int32), cache)
  new = np.stack([full[b, lengths[b]:lengths[b] + 4] for b in range(2)])
  logits, cache = jax.jit(definition.extend)(params, jnp.asarray(new, jnp.int32), cache)
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 4)
  for b in range(2):
    reference = _hf_logits(hf_model, full[b:b + 1, :lengths[b] + 4])[0]
    assert np.max(np.abs(np.asarray(last[b]) - reference[lengths[b] - 1])) < TOLERANCE
    assert np.max(np.abs(np.asarray(logits[b]) - reference[lengths[b]:])) < TOLERANCE


def test_bfloat16_checkpoint_loads(tmp_path):
  hf_model = _save_random_hf_llama(tmp_path)
  hf_model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
  model = hf_llama.load_model(tmp_path)  # float32 parameters from a bfloat16 file
  embedding = hf_model.model.embed_tokens.weight.float().detach().numpy()
  np.testing.assert_array_equal(np.asarray(model.params['embedder']['embedding']), embedding)


def test_config_from_transformers4_keys():
  config = hf_llama.config_from_hf({
      'model_type': 'llama', 'vocab_size': 10, 'hidden_size': 8, 'intermediate_size': 16,
      'num_hidden_layers': 1, 'num_attention_heads': 2, 'rope_theta': 1234.0,
      'rope_scaling': {'type': 'linear', 'factor': 2.0}, 'tie_word_embeddings': True})
  assert config.rope_theta == 1234.0
  assert config.rope_scaling == llama.RopeScaling(kind='linear', factor=2.0)
  assert config.num_kv_heads == 2 and config.head_dim == 4 and config.tie_embeddings
  assert config.max_position_embeddings is None  # not in this config.json: unknown
  assert 'max_position_embeddings' not in hf_llama.config_to_hf(config)


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='config.json'):
    hf_llama.load_model(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'gpt2'}))
  with pytest.raises(ValueError, match='gpt2'):
    hf_llama.load_model(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps({
      'model_type': 'llama', 'vocab_size': 10, 'hidden_size': 8, 'intermediate_size': 16,
      'num_hidden_layers': 1, 'num_attention_heads': 2}))
  (tmp_path / 'pytorch_model.bin').write_bytes(b'not read')
  with pytest.raises(FileNotFoundError, match='never loads'):
    hf_llama.load_model(tmp_path)
  (tmp_path / 'model.safetensors').write_bytes(b'\xff' * 16)
  with pytest.raises(ValueError, match='safetensors'):
    hf_llama.load_model(tmp_path)
  with pytest.raises(ValueError, match='RoPE scaling'):
    hf_llama.config_from_hf({'vocab_size': 10, 'hidden_size': 8, 'intermediate_size': 16,
                             'num_hidden_layers': 1, 'num_attention_heads': 2,
                             'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0}})
  assert os.path.exists(tmp_path / 'pytorch_model.bin')


def test_nan_or_inf_weights_are_refused(tmp_path):
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  from speclm import partitioning  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import sharded  # pylint: disable=import-outside-toplevel
  _save_random_hf_llama(tmp_path)
  path = tmp_path / 'model.safetensors'
  weights = st_numpy.load_file(str(path))
  weights['model.layers.1.mlp.down_proj.weight'][7, [2, 40]] = [np.nan, np.inf]
  st_numpy.save_file(weights, str(path))
  message = ("arameter 'layers_1/mlp/down/kernel' in {} has 2 NaN/Inf values (of 3840); the"
             ' checkpoint is corrupt.').format(tmp_path)
  with pytest.raises(ValueError, match='^' + re.escape('P' + message)):
    hf_llama.load_model(tmp_path)
  with pytest.raises(ValueError, match='^' + re.escape('target p' + message)):
    sharded.load_hf_llama_sharded(tmp_path, partitioning.Partitioner(num_partitions=1))


def _save_tiny_tokenizer(directory):
  """A tiny byte-level BPE trained on a few sentences, saved as a HF tokenizer directory."""
  tokenizers = pytest.importorskip('tokenizers')
  from tokenizers import decoders, models, pre_tokenizers, trainers
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=['<s>', '</s>', '<pad>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(['the cat sat on the mat', 'speculative decoding is exact',
                               'a draft proposes and the target verifies'] * 5, trainer)
  backend.save(str(directory / 'tokenizer.json'))
  template = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}"
              "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}{{ bos_token }}"
              "assistant:{% endif %}")
  (directory / 'tokenizer_config.json').write_text(json.dumps({
      'bos_token': '<s>', 'eos_token': '</s>', 'pad_token': '<pad>',
      'chat_template': template}))


def test_tokenizer_from_directory(tmp_path):
  from speclm import tokenizer  # pylint: disable=import-outside-toplevel
  _save_tiny_tokenizer(tmp_path)
  tok = tokenizer.Tokenizer.from_pretrained_dir(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
  for text in ['the cat sat on the mat', 'Unseen words, 123 and ünïcode!']:
    assert tok.decode(tok.encode(text)) == text
  messages = [{'role': 'user', 'content': 'hello there'}]
  rendered = tok.render_chat(messages)
  assert rendered == '<s>user: hello there</s>\n<s>assistant:'
  reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
  assert rendered == reference.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
  assert tok.encode_chat(messages) == reference.encode(rendered, add_special_tokens=False)
  tokens, lengths = tok.batch(['the cat', 'a draft proposes and the target verifies'])
  assert tokens.shape == (2, int(lengths.max())) and np.all(tokens[0, lengths[0]:] == 2)


@pytest.mark.parametrize('case', sorted(CASES))
def test_export_to_transformers_round_trips(tmp_path, case):
  """HF -> ours -> HF: the exported `LlamaForCausalLM` has the original's weights and logits."""
  original = _save_random_hf_llama(tmp_path, **CASES[case])
  ours = hf_llama.load_model(tmp_path)
  exported = hf_llama.to_transformers(ours)
  assert exported.config.tie_word_embeddings == original.config.tie_word_embeddings
  assert hf_llama.config_to_hf(ours.definition.config)['max_position_embeddings'] == 256
  assert exported.config.max_position_embeddings == original.config.max_position_embeddings
  state = exported.state_dict()
  for name, value in original.state_dict().items():
    if name.endswith('rotary_emb.inv_freq'):
      continue
    np.testing.assert_array_equal(state[name].numpy(), value.numpy(), err_msg=name)
  tokens = np.array([[1, 5, 9, 33, 2, 96, 40, 7]])
  np.testing.assert_allclose(_hf_logits(exported, tokens), _hf_logits(original, tokens),
                             atol=1e-6)


@pytest.mark.parametrize('tie', [True, False])
def test_subset_draft_exports_with_the_same_logits(tie):
  """A subset-vocabulary draft as a HF model: equal logits on the subset, −inf elsewhere,
  with input ids both inside and outside the subset."""
  from speclm.models import subset_vocab  # pylint: disable=import-outside-toplevel
  subset = np.array([0, 3, 4, 9, 20, 21, 50, 96])
  inner = llama.random_model(vocab_size=len(subset) + 1, embed_dim=32, num_layers=2, seed=3,
                             tie_embeddings=tie)
  draft = subset_vocab.wrap(inner if tie else llama.untie_head(inner), subset, 97)
  exported = hf_llama.subset_draft_to_transformers(draft)
  tokens = np.array([[0, 5, 9, 33, 96, 2, 21, 7]])  # 5, 33, 2 and 7 are outside the subset
  cache = draft.definition.init_cache(1, tokens.shape[1])
  ours = np.asarray(draft.definition.extend(draft.params, jnp.asarray(tokens), cache)[0])
  theirs = _hf_logits(exported, tokens)
  assert np.array_equal(np.isfinite(ours), np.isfinite(theirs))
  assert np.isfinite(theirs[..., subset]).all() and np.isneginf(np.delete(theirs, subset, -1)).all()
  np.testing.assert_allclose(theirs[..., subset], ours[..., subset], atol=1e-5)
