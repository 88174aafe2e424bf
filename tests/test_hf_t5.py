"""Hugging Face T5 directories: logits parity with transformers, conversion to T5X, errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from safetensors import numpy as st_numpy

from speclm import checkpoints
from speclm.checkpoints import hf_t5
from speclm.checkpoints import safetensors_io
from speclm.models import t5

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

REPO = Path(__file__).resolve().parents[1]

# Right-padded encoder inputs of different lengths, and teacher-forced decoder inputs.
INPUTS = np.array([[5, 6, 7, 8, 9, 10, 11, 1],
                   [12, 13, 14, 1, 0, 0, 0, 0],
                   [15, 16, 17, 18, 19, 1, 0, 0]], np.int64)
LENGTHS = np.array([8, 4, 6], np.int64)
DECODER = np.array([[0, 4, 5, 6, 7, 8],
                    [0, 9, 10, 11, 12, 13],
                    [0, 20, 21, 22, 23, 24]], np.int64)


def _save_hf_t5(directory: Path, version: str, seed: int = 0):
  """A random HF T5 of the given version saved as config.json + model.safetensors."""
  config = transformers.T5Config(
      vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
      num_heads=4, feed_forward_proj='relu' if version == '1.0' else 'gated-gelu',
      tie_word_embeddings=version == '1.0', decoder_start_token_id=0, pad_token_id=0,
      eos_token_id=1)
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(config).eval()
  if version == '1.0':
    model.save_pretrained(directory, safe_serialization=True)
  else:
    # T5 1.1 has an output layer of its own. transformers >= 5 ties lm_head to the embedding
    # when saving, so give it distinct weights and write every tensor ourselves.
    model.lm_head.weight = torch.nn.Parameter(torch.randn(96, 32))
    config.save_pretrained(directory)
    st_numpy.save_file({k: v.detach().numpy() for k, v in model.state_dict().items()},
                       str(directory / 'model.safetensors'))
  return model


def _hf_logits(model) -> np.ndarray:
  mask = (np.arange(INPUTS.shape[1])[None] < LENGTHS[:, None]).astype(np.int64)
  with torch.no_grad():
    return model(input_ids=torch.tensor(INPUTS), attention_mask=torch.tensor(mask),
                 decoder_input_ids=torch.tensor(DECODER)).logits.numpy()


@pytest.fixture(scope='module', params=['1.0', '1.1'])
def hf_model(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(f'hf_t5_{request.param}')
  model = _save_hf_t5(directory, request.param)
  return request.param, directory, model


def test_logits_match_transformers(hf_model):
  version, directory, model = hf_model
  config, params = hf_t5.load_hf_t5(directory)
  assert config.version == version
  assert (config.emb_dim, config.num_heads, config.head_dim, config.mlp_dim) == (32, 4, 8, 48)
  assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 3)
  definition = t5.T5(config)
  definition.validate_params(params)
  ours = np.asarray(definition.forward(params, INPUTS, LENGTHS, DECODER))
  reference = _hf_logits(model)
  # Only real (unpadded) decoder positions exist here, so every logit is compared.
  assert np.max(np.abs(ours - reference)) < 1e-4, np.max(np.abs(ours - reference))
  # Cached decoding through the protocol gives the same logits.
  first, _ = jax.jit(definition.prefill)(params, INPUTS.astype(np.int32),
                                         LENGTHS.astype(np.int32), definition.init_cache(3, 6))
  assert np.max(np.abs(np.asarray(first) - reference[:, 0])) < 1e-4


def test_converted_t5x_checkpoint_gives_same_logits(hf_model, tmp_path):
  version, directory, model = hf_model
  output = tmp_path / 'checkpoint_0'
  result = subprocess.run(
      [sys.executable, str(REPO / 'scripts' / 'convert_hf_to_t5x.py'), f'--hf_dir={directory}',
       f'--output_dir={output}'], capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert f'T5 {version}' in result.stdout
  config, _ = hf_t5.load_hf_t5(directory)
  definition = t5.T5(config)
  params = checkpoints.load_t5_params(output, definition)  # detected as legacy T5X
  ours = np.asarray(definition.forward(params, INPUTS, LENGTHS, DECODER))
  assert np.max(np.abs(ours - _hf_logits(model))) < 1e-4


def test_load_t5_params_detects_hf_directories(hf_model):
  _, directory, _ = hf_model
  config, params = hf_t5.load_hf_t5(directory)
  again = checkpoints.load_t5_params(directory, t5.T5(config))
  np.testing.assert_array_equal(again['token_embedder']['embedding'],
                                params['token_embedder']['embedding'])


def test_config_mapping_of_public_checkpoints():
  # transformers < 5 style configs of google/t5-v1_1-small and t5-small.
  v1_1 = hf_t5.config_from_hf({
      'vocab_size': 32128, 'd_model': 512, 'd_kv': 64, 'd_ff': 1024, 'num_layers': 8,
      'num_decoder_layers': 8, 'num_heads': 6, 'feed_forward_proj': 'gated-gelu',
      'tie_word_embeddings': False})
  assert v1_1.version == '1.1' and t5.count_params(v1_1) == 76_961_152
  v1_0 = hf_t5.config_from_hf({
      'vocab_size': 32128, 'd_model': 512, 'd_kv': 64, 'd_ff': 2048, 'num_layers': 6,
      'num_heads': 8, 'feed_forward_proj': 'relu'})
  assert v1_0.version == '1.0' and v1_0.num_decoder_layers == 6
  # transformers >= 5 writes tie_word_embeddings=True always and scale_decoder_outputs.
  v5 = hf_t5.config_from_hf({
      'vocab_size': 32128, 'd_model': 512, 'd_kv': 64, 'd_ff': 1024, 'num_layers': 8,
      'num_heads': 6, 'feed_forward_proj': 'gated-gelu', 'tie_word_embeddings': True,
      'scale_decoder_outputs': False})
  assert v5.version == '1.1'
  with pytest.raises(ValueError, match='feed_forward_proj'):
    hf_t5.config_from_hf({'vocab_size': 8, 'd_model': 8, 'd_kv': 2, 'd_ff': 8, 'num_layers': 1,
                          'num_heads': 4, 'feed_forward_proj': 'gated-mystery'})


@pytest.mark.parametrize('version', ['1.0', '1.1'])
def test_to_transformers_gives_same_logits_and_greedy_generation(version):
  # Our random weights exported in memory (the benchmark's route to HF generate()).
  model = t5.random_model(vocab_size=96, emb_dim=32, num_layers=2, num_heads=4, head_dim=8,
                          mlp_dim=48, version=version, seed=3)
  config = model.definition.config
  assert hf_t5.config_from_hf(hf_t5.config_to_hf(config)) == config
  hf_model = hf_t5.to_transformers(model)
  ours = np.asarray(model.definition.forward(model.params, INPUTS, LENGTHS, DECODER))
  assert np.max(np.abs(ours - _hf_logits(hf_model))) < 1e-4
  # Greedy generation on both sides, one row.
  import speclm  # pylint: disable=g-import-not-at-top
  ids = INPUTS[:1, :LENGTHS[0]]
  with torch.no_grad():
    theirs = hf_model.generate(torch.tensor(ids), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False).numpy()[0, 1:]  # after the start token
  mine = speclm.autoregressive_decode(model, ids.astype(np.int32), np.array([ids.shape[1]]),
                                      max_new_tokens=8, eos_id=None)
  np.testing.assert_array_equal(np.asarray(mine.tokens)[0], theirs)


def test_config_to_hf_refuses_unnamed_wirings():
  with pytest.raises(ValueError, match='feed_forward_proj'):
    hf_t5.config_to_hf(t5.tiny_config(mlp_activations=('gelu', 'silu')))


def test_relative_position_buckets_match_transformers():
  from transformers.models.t5 import modeling_t5  # pylint: disable=g-import-not-at-top
  rel = np.arange(-300, 301)
  for bidirectional in (True, False):
    theirs = modeling_t5.T5Attention._relative_position_bucket(  # pylint: disable=protected-access
        torch.tensor(rel), bidirectional=bidirectional, num_buckets=32, max_distance=128)
    ours = t5.relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32,
                                       max_distance=128)
    # The two differ only where float32 rounding sits on a bucket edge (T5X adds ε in the log).
    assert np.mean(ours == theirs.numpy()) > 0.98
    small = np.abs(rel) < 16
    np.testing.assert_array_equal(ours[small], theirs.numpy()[small])


# ----------------------------------------------------------------------------------------------
# Errors


def test_shape_mismatch_names_parameter_and_both_shapes(hf_model):
  _, directory, _ = hf_model
  config, _ = hf_t5.load_hf_t5(directory)
  import dataclasses  # pylint: disable=g-import-not-at-top
  wrong = dataclasses.replace(config, mlp_dim=40)
  with pytest.raises(checkpoints.CheckpointError, match=r'mlp/w.*\(32, 48\).*\(32, 40\)'):
    hf_t5.load_hf_t5(directory, config=wrong)
  other_version = t5.tiny_config(vocab_size=96, emb_dim=32, num_heads=4, head_dim=8,
                                 mlp_dim=48, num_layers=2, num_decoder_layers=3,
                                 version='1.1' if config.version == '1.0' else '1.0')
  with pytest.raises(checkpoints.CheckpointError, match='does not match.*mlp_activations'):
    hf_t5.load_hf_t5(directory, config=other_version)


def test_missing_directory_and_files(tmp_path):
  with pytest.raises(checkpoints.CheckpointError, match=f'not found: {tmp_path / "absent"}'):
    hf_t5.load_hf_t5(tmp_path / 'absent')
  with pytest.raises(checkpoints.CheckpointError, match='config.json'):
    hf_t5.load_hf_t5(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps({
      'vocab_size': 8, 'd_model': 8, 'd_kv': 2, 'd_ff': 8, 'num_layers': 1, 'num_heads': 4}))
  (tmp_path / 'pytorch_model.bin').write_bytes(b'pickle')
  with pytest.raises(checkpoints.CheckpointError, match='pickle.*never loads'):
    hf_t5.load_hf_t5(tmp_path)


def test_truncated_and_corrupt_safetensors(hf_model, tmp_path):
  _, directory, _ = hf_model
  (tmp_path / 'config.json').write_bytes((directory / 'config.json').read_bytes())
  data = (directory / 'model.safetensors').read_bytes()
  target = tmp_path / 'model.safetensors'
  target.write_bytes(data[:len(data) - 100])
  with pytest.raises(checkpoints.CheckpointError, match=f'Truncated.*{target}'):
    hf_t5.load_hf_t5(tmp_path)
  target.write_bytes(data[:5])
  with pytest.raises(checkpoints.CheckpointError, match=f'Truncated.*{target}'):
    hf_t5.load_hf_t5(tmp_path)
  target.write_bytes(b'\xff' * 64)
  with pytest.raises(checkpoints.CheckpointError, match=str(target)):
    hf_t5.load_hf_t5(tmp_path)


def test_nan_or_inf_weights_are_refused(hf_model, tmp_path):
  version, directory, _ = hf_model
  (tmp_path / 'config.json').write_bytes((directory / 'config.json').read_bytes())
  weights = st_numpy.load_file(str(directory / 'model.safetensors'))
  weights['encoder.block.1.layer.0.SelfAttention.q.weight'][4, :3] = np.nan
  st_numpy.save_file(weights, str(tmp_path / 'model.safetensors'))
  with pytest.raises(checkpoints.CheckpointError, match=re.escape(
      f"Parameter 'encoder/layers_1/attention/query/kernel' in {tmp_path} has 3 NaN/Inf values"
      ' (of 1024); the checkpoint is corrupt.')):
    hf_t5.load_hf_t5(tmp_path)
  # T5's positions are relative: no context length is built into the model.
  config, _ = hf_t5.load_hf_t5(directory)
  assert t5.T5(config).max_context_length is None, version


def test_safetensors_reading_including_bfloat16_and_shards(tmp_path):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  tensors = {'a': np.arange(6, dtype=np.float32).reshape(2, 3),
             'b': np.array([1.5, -2.0], ml_dtypes.bfloat16), 'c': np.zeros((0,), np.int64)}
  st_numpy.save_file({k: tensors[k] for k in 'ab'}, str(tmp_path / 'x-1.safetensors'),
                     metadata={'format': 'np'})
  st_numpy.save_file({'c': tensors['c']}, str(tmp_path / 'x-2.safetensors'))
  loaded = safetensors_io.Tensors([tmp_path / 'x-1.safetensors', tmp_path / 'x-2.safetensors'])
  assert set(loaded) == set(tensors) and len(loaded) == 3
  assert loaded.path('c') == str(tmp_path / 'x-2.safetensors')
  for name, value in tensors.items():
    assert loaded[name].dtype == value.dtype and loaded.shape(name) == value.shape
    np.testing.assert_array_equal(loaded[name], value)
  np.testing.assert_array_equal(loaded.read('a', (slice(1, 2), slice(0, 2))), [[3, 4]])
  assert loaded.read('b', (slice(1, 2),)).dtype == ml_dtypes.bfloat16
