"""Sharding checks that need several devices; run by tests/test_partitioning.py in a subprocess.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multidevice_checks.py decode

JAX fixes its device count when it starts, so these run in their own process with 8 host CPU
devices while the rest of the suite keeps one. Each check prints one JSON line
`RESULT {...}` that the test parses. Checks: 'decode' (meshes 1x8, 8x1, 2x4 against one
device, T5 and Llama) and 'checkpoints' (sharded T5X and safetensors reads).
"""

import json
import os
import sys
import tempfile

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from speclm import decoding  # pylint: disable=wrong-import-position
from speclm import partitioning  # pylint: disable=wrong-import-position
from speclm import trees  # pylint: disable=wrong-import-position
from speclm.models import llama  # pylint: disable=wrong-import-position
from speclm.models import t5  # pylint: disable=wrong-import-position

# (data, model) meshes; num_partitions is the model axis.
MESHES = {'1x8': 8, '8x1': 1, '2x4': 4}
BATCH, GAMMA, MAX_NEW = 8, 3, 8
# Shapes chosen so every split dimension divides 8 (V 64, N 8, F 64), except the Llama's 4
# key/value heads, which an 8-way 'model' axis cannot split (they are then replicated).
LLAMA = dict(vocab_size=64, embed_dim=32, num_heads=8, num_kv_heads=4, head_dim=4, mlp_dim=64)
T5 = dict(vocab_size=64, emb_dim=32, num_heads=8, head_dim=4, mlp_dim=64)
# Parameters whose per-device shapes the test checks.
WATCHED = {
    'gemma3': ['layers_0/attention/query/kernel', 'layers_0/attention/query_norm/scale',
               'layers_0/post_mlp_norm/scale'],
    'llama': ['embedder/embedding', 'layers_0/attention/query/kernel',
              'layers_0/attention/key/kernel', 'layers_0/attention/out/kernel',
              'layers_0/mlp/gate/kernel', 'layers_0/mlp/down/kernel', 'final_norm/scale'],
    't5': ['token_embedder/embedding', 'encoder/layers_0/attention/query/kernel',
           'encoder/layers_0/attention/out/kernel', 'decoder/layers_0/mlp/wi_0/kernel',
           'decoder/layers_0/mlp/wo/kernel', 'decoder/logits_dense/kernel',
           'decoder/relpos_bias/rel_embedding', 'decoder/decoder_norm/scale'],
}


def _models(kind):
  if kind == 'llama':
    target = llama.random_model(num_layers=2, seed=0, **LLAMA)
    draft = llama.random_model(num_layers=1, seed=0, **LLAMA)  # shares embedding and layer 0
  elif kind == 'gemma3':  # a new family: q/k norms, post norms, a sliding layer, soft-capping
    switches = dict(family='gemma3', sliding_window=4, final_logit_softcap=10.0, **LLAMA)
    target = llama.random_model(num_layers=2, seed=3, layer_types=('sliding', 'full'),
                                **switches)
    draft = llama.random_model(num_layers=1, seed=4, layer_types=('sliding',), **switches)
  else:
    target = t5.random_model(num_layers=2, seed=0, **T5)
    draft = t5.random_model(vocab_size=64, emb_dim=16, num_layers=1, num_heads=2, seed=1)
  return target, draft


def _prompts():
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, 64, size=(BATCH, 6)).astype(np.int32)
  lengths = np.array([6, 3, 5, 1, 4, 6, 2, 5], np.int32)
  return prompts, lengths


def _shard_shapes(tree, names):
  flat = trees.flatten(tree)
  return {n: [list(flat[n].shape), [list(s.data.shape) for s in flat[n].addressable_shards][0],
              str(flat[n].sharding.spec)] for n in names}


def check_decode():
  out = {'devices': jax.device_count()}
  prompts, lengths = _prompts()
  for kind in ('llama', 'gemma3', 't5'):
    target, draft = _models(kind)
    ref = decoding.speculative_decode(target, draft, prompts, lengths, gamma=GAMMA,
                                      max_new_tokens=MAX_NEW)
    base = decoding.autoregressive_decode(target, prompts, lengths, max_new_tokens=MAX_NEW)
    ref_tokens = ref.to_lists()
    assert ref_tokens == base.to_lists(), 'single-device speculative != baseline'
    # Teacher-forced logits of the generated continuation, on one device.
    generated = np.asarray(ref.tokens)
    capacity = prompts.shape[1] + MAX_NEW + 1
    d = target.definition
    first, cache = jax.jit(d.prefill)(target.params, prompts, lengths,
                                      d.init_cache(BATCH, capacity))
    rest, _ = jax.jit(d.extend)(target.params, generated, cache)
    entry = {'reference_tokens': ref_tokens}
    meshes = {'2x4': MESHES['2x4']} if kind == 'gemma3' else MESHES  # a new family: one mesh
    for mesh_name, num_partitions in meshes.items():
      partitioner = partitioning.Partitioner(num_partitions=num_partitions)
      sharded_target = partitioner.shard_model(target)
      sharded_draft = partitioner.shard_model(draft, role='draft')
      result = decoding.speculative_decode(sharded_target, sharded_draft, prompts, lengths,
                                           gamma=GAMMA, max_new_tokens=MAX_NEW,
                                           partitioner=partitioner)
      s_first, s_cache = partitioner.prefill(sharded_target, prompts, lengths, capacity)
      s_rest, s_cache = partitioner.extend(sharded_target, generated, s_cache)
      diff = max(float(np.max(np.abs(np.asarray(s_first) - np.asarray(first)))),
                 float(np.max(np.abs(np.asarray(s_rest) - np.asarray(rest)))))
      entry[mesh_name] = {
          'mesh': partitioner.mesh_shape,
          'tokens': result.to_lists(),
          'target_calls': int(result.stats.target_calls),
          'logits_max_abs_diff': diff,
          'logits_max_abs': float(np.max(np.abs(np.asarray(rest)))),
          'params': _shard_shapes(sharded_target.params, WATCHED[kind]),
          'draft_params_replicated': all(
              a.sharding.is_fully_replicated for a in jax.tree.leaves(sharded_draft.params)),
          'cache_keys': [list(s_cache.keys.shape),
                         list(s_cache.keys.addressable_shards[0].data.shape)],
          'result_sharding': str(result.tokens.sharding.spec),
      }
    out[kind] = entry
  return out


def check_checkpoints():
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  from speclm.checkpoints import sharded  # pylint: disable=g-import-not-at-top
  from speclm.checkpoints import t5x  # pylint: disable=g-import-not-at-top
  out = {}
  partitioner = partitioning.Partitioner(num_partitions=4)  # 2 x 4
  tmp = tempfile.mkdtemp()

  # T5X legacy checkpoint written with every array of 512+ bytes in zarr (read by TensorStore).
  model = t5.random_model(num_layers=2, seed=3, **T5)
  path = os.path.join(tmp, 'checkpoint_1')
  t5x.save_t5x_checkpoint(path, jax.device_get(model.params), step=1, zarr_min_bytes=512)
  log = []
  params = sharded.load_t5x_sharded(path, model.definition, partitioner, read_log=log)
  flat_ref, flat_got = trees.flatten(model.params), trees.flatten(params)
  out['t5x_equal'] = all(np.array_equal(np.asarray(flat_got[n]), np.asarray(flat_ref[n]))
                         for n in flat_ref)
  out['t5x_shardings_match'] = all(
      flat_got[n].sharding.is_equivalent_to(s, flat_got[n].ndim) for n, s in
      trees.flatten(partitioner.param_shardings(model.definition, model.params)).items())
  out['t5x_reads'] = _read_summary(log, flat_got)
  out['t5x_zarr_arrays'] = sum(1 for p in os.listdir(path) if p.startswith('target.'))

  # The shared real T5X fixture (inline msgpack arrays) restored into shards.
  fixture = os.path.join(REPO, '..', 'shared', 'fixtures', 't5x', 'test_t5_tiny.checkpoint_0')
  if os.path.exists(fixture):
    import gin  # pylint: disable=g-import-not-at-top
    # speclm.models.t5 imports no gin; register T5Config as the job layer does.
    config_class = gin.external_configurable(t5.T5Config, module='speclm.models.t5')
    gin.parse_config_files_and_bindings(
        [os.path.join(REPO, 'configs', 'models', 't5_1_1', 'tiny.gin')], [])
    with gin.config_scope('t5_1_1_tiny'):
      definition = t5.T5(config_class())
    gin.clear_config()
    whole = t5x.load_t5x_checkpoint(fixture, expected=definition.param_shapes())
    got = trees.flatten(sharded.load_t5x_sharded(fixture, definition, partitioner))
    out['fixture_equal'] = all(np.array_equal(np.asarray(got[n]), v)
                               for n, v in trees.flatten(whole).items())
    emb = got['token_embedder/embedding']
    out['fixture_embedding'] = [list(emb.shape), list(emb.addressable_shards[0].data.shape)]

  # A Hugging Face Llama directory (safetensors, HF names and [out, in] layout).
  from speclm.checkpoints import hf_llama  # pylint: disable=g-import-not-at-top
  cfg = llama.LlamaConfig(num_layers=2, tie_embeddings=False, **LLAMA)
  hf_dir = os.path.join(tmp, 'hf')
  os.makedirs(hf_dir)
  rng = np.random.default_rng(0)
  d, n, nkv, h, f, v = 32, 8, 4, 4, 64, 64
  weights = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,),
             'lm_head.weight': (v, d)}
  for i in range(2):
    p = f'model.layers.{i}.'
    weights.update({p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight':
                    (d,), p + 'self_attn.q_proj.weight': (n * h, d),
                    p + 'self_attn.k_proj.weight': (nkv * h, d),
                    p + 'self_attn.v_proj.weight': (nkv * h, d),
                    p + 'self_attn.o_proj.weight': (d, n * h), p + 'mlp.gate_proj.weight': (f, d),
                    p + 'mlp.up_proj.weight': (f, d), p + 'mlp.down_proj.weight': (d, f)})
  weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in weights.items()}
  # Two shards, as save_pretrained writes large models.
  names = sorted(weights)
  st_numpy.save_file({k: weights[k] for k in names[::2]},
                     os.path.join(hf_dir, 'model-00001-of-00002.safetensors'))
  st_numpy.save_file({k: weights[k] for k in names[1::2]},
                     os.path.join(hf_dir, 'model-00002-of-00002.safetensors'))
  with open(os.path.join(hf_dir, 'config.json'), 'w') as fh:
    json.dump({'model_type': 'llama', 'vocab_size': v, 'hidden_size': d,
               'num_hidden_layers': 2, 'num_attention_heads': n, 'num_key_value_heads': nkv,
               'head_dim': h, 'intermediate_size': f, 'tie_word_embeddings': False}, fh)
  log = []
  got_model = sharded.load_hf_llama_sharded(hf_dir, partitioner, read_log=log)
  want = trees.flatten(hf_llama.params_from_hf(weights, cfg))
  got = trees.flatten(got_model.params)
  out['hf_equal'] = all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)
  out['hf_reads'] = _read_summary(log, got)
  return out


def _read_summary(log, arrays):
  """Largest read relative to its array and to one device's shard, over every read."""
  worst_fraction, over_shard = 0.0, []
  for name, shape in log:
    arr = arrays[name]
    fraction = float(np.prod(shape)) / float(np.prod(arr.shape))
    worst_fraction = max(worst_fraction, fraction)
    if tuple(shape) != tuple(arr.sharding.shard_shape(arr.shape)):
      over_shard.append(name)
  split = {n for n, a in arrays.items()
           if tuple(a.sharding.shard_shape(a.shape)) != tuple(a.shape)}
  split_reads = [f for f in (float(np.prod(s)) / float(np.prod(arrays[n].shape))
                             for n, s in log if n in split)]
  return {'num_reads': len(log), 'reads_not_shard_shaped': over_shard,
          'max_fraction_of_split_array_read': max(split_reads) if split_reads else None,
          'num_split_arrays': len(split), 'max_fraction_any': worst_fraction}


def check_global(port, process_id):
  """One 2x4 mesh over two processes' devices (4 each): sharded speculative decoding on the
  same prompts in every process, against this process's single-device result."""
  partitioning.initialize_distributed(coordinator_address=f'localhost:{port}', num_processes=2,
                                      process_id=int(process_id), enabled=True)
  prompts, lengths = _prompts()
  target, draft = _models('llama')
  ref = decoding.speculative_decode(target, draft, prompts, lengths, gamma=GAMMA,
                                    max_new_tokens=MAX_NEW)
  partitioner = partitioning.Partitioner(num_partitions=4, devices='global')
  result = decoding.speculative_decode(
      partitioner.shard_model(target), partitioner.shard_model(draft, 'draft'), prompts,
      lengths, gamma=GAMMA, max_new_tokens=MAX_NEW, partitioner=partitioner)
  tokens = np.asarray(result.tokens.addressable_data(0))  # replicated: the whole result
  lens = np.asarray(result.lengths.addressable_data(0))
  got = [tokens[b, :lens[b]].tolist() for b in range(BATCH)]
  return {'process_count': jax.process_count(), 'devices': jax.device_count(),
          'local_devices': jax.local_device_count(), 'mesh': partitioner.mesh_shape,
          'same_tokens': got == ref.to_lists()}


CHECKS = {'decode': check_decode, 'checkpoints': check_checkpoints, 'global': check_global}

if __name__ == '__main__':
  if sys.argv[1] == 'global':
    print('RESULT ' + json.dumps({'global': check_global(*sys.argv[2:4])}), flush=True)
    sys.exit(0)
  for check in sys.argv[1:]:
    print('RESULT ' + json.dumps({check: CHECKS[check]()}), flush=True)
