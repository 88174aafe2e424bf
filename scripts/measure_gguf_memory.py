r"""Peak resident memory of a large quantized GGUF model loaded with its matrices kept as stored.

  python scripts/measure_gguf_memory.py --shape=7b --path=/tmp/llama7b_q4k.gguf

Writes (once; kept for reruns) a Llama of the given shape with random weights as GGUF, every
matrix and the embedding table in `--quant` blocks (random bytes with finite float16 scales,
through the `gguf` package's writer), the norms in F32. Then, in a fresh process, loads it
with `gguf.load_model(path, quantized=True)`, decodes `--new_tokens` tokens greedily after a
prompt of `--prompt_tokens`, and reports that process's peak resident set size (the kernel's
`ru_maxrss`), the bytes of the weights as held, the load time and the time per token. Exits 1
if the peak is at or above `--max_rss`.

Shapes: '7b' (Llama 2 7B: 32 layers, width 4096, MLP 11008, 32 heads, vocabulary 32000; a
Q4_K file of 3.8 GB) and 'tiny' (the same code on a 2-layer model, for the test suite).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

_SHAPES = {
    '7b': dict(vocab=32000, width=4096, mlp=11008, layers=32, heads=32, kv_heads=32),
    'tiny': dict(vocab=512, width=256, mlp=512, layers=2, heads=4, kv_heads=2),
}
_SHAPE = flags.DEFINE_enum('shape', '7b', list(_SHAPES), 'The model shape.')
_QUANT = flags.DEFINE_enum('quant', 'Q4_K', ['Q4_K', 'Q5_K', 'Q6_K', 'Q8_0', 'Q4_0', 'Q4_1'],
                           'The block type of every matrix.')
_PATH = flags.DEFINE_string('path', None, 'The GGUF file (written if missing).', required=True)
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 4, 'Tokens decoded after the prompt.')
_PROMPT_TOKENS = flags.DEFINE_integer('prompt_tokens', 8, 'Prompt length.')
_MAX_RSS = flags.DEFINE_string('max_rss', '8G', 'Fail at or above this peak resident size.')
_DECODE = flags.DEFINE_bool('decode', False, 'Internal: the child process that loads and'
                            ' decodes, printing its figures as one JSON line.')

# Byte offsets of each block type's float16 scales -> the value they get (a small d, and a
# dmin of about d × the mean quant, so that the weights average about 0).
_SCALES = {'Q4_K': {0: 1e-4, 2: 7.5e-4}, 'Q5_K': {0: 5e-5, 2: 7.5e-4}, 'Q6_K': {208: 1e-4},
           'Q8_0': {0: 1e-3}, 'Q4_0': {0: 1e-2}, 'Q4_1': {0: 1e-2, 2: -7.5e-2}}


def _blocks(rows: int, cols: int, rng) -> np.ndarray:
  import gguf  # pylint: disable=import-outside-toplevel
  kind = gguf.GGMLQuantizationType[_QUANT.value]
  weights, size = gguf.GGML_QUANT_SIZES[kind]
  raw = rng.integers(0, 256, (rows * cols // weights, size), dtype=np.uint8)
  for offset, value in _SCALES[_QUANT.value].items():
    raw[:, offset:offset + 2] = np.full((len(raw), 1), value, np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


def write(path: str) -> None:
  """The random model as GGUF, tensor by tensor (spooled to a temporary file, not memory)."""
  import gguf  # pylint: disable=import-outside-toplevel
  s = _SHAPES[_SHAPE.value]
  head_dim = s['width'] // s['heads']
  kind = gguf.GGMLQuantizationType[_QUANT.value]
  writer = gguf.GGUFWriter(path + '.partial', 'llama', use_temp_file=True)
  writer.add_block_count(s['layers'])
  writer.add_context_length(4096)
  writer.add_embedding_length(s['width'])
  writer.add_feed_forward_length(s['mlp'])
  writer.add_head_count(s['heads'])
  writer.add_head_count_kv(s['kv_heads'])
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_freq_base(10000.0)
  writer.add_vocab_size(s['vocab'])
  writer.add_rope_dimension_count(head_dim)
  rng = np.random.default_rng(0)
  matrices = {'token_embd.weight': (s['vocab'], s['width']),
              'output.weight': (s['vocab'], s['width'])}
  for i in range(s['layers']):
    matrices.update({
        f'blk.{i}.attn_q.weight': (s['heads'] * head_dim, s['width']),
        f'blk.{i}.attn_k.weight': (s['kv_heads'] * head_dim, s['width']),
        f'blk.{i}.attn_v.weight': (s['kv_heads'] * head_dim, s['width']),
        f'blk.{i}.attn_output.weight': (s['width'], s['heads'] * head_dim),
        f'blk.{i}.ffn_gate.weight': (s['mlp'], s['width']),
        f'blk.{i}.ffn_up.weight': (s['mlp'], s['width']),
        f'blk.{i}.ffn_down.weight': (s['width'], s['mlp']),
    })
  for name, (rows, cols) in matrices.items():
    writer.add_tensor(name, _blocks(rows, cols, rng), raw_dtype=kind)
  norms = ['output_norm.weight'] + [f'blk.{i}.{n}.weight' for i in range(s['layers'])
                                    for n in ('attn_norm', 'ffn_norm')]
  for name in norms:
    writer.add_tensor(name, np.ones(s['width'], np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  os.replace(path + '.partial', path)


def decode(path: str) -> dict:
  """Loads `path` with its matrices kept as stored and decodes greedily; the figures."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import speclm  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import gguf as gguf_reader  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import memory  # pylint: disable=import-outside-toplevel
  start = time.time()
  model = gguf_reader.load_model(path, quantized=True)
  load_s = time.time() - start
  after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  prompt = jnp.arange(1, _PROMPT_TOKENS.value + 1, dtype=jnp.int32)[None]
  lengths = jnp.asarray([_PROMPT_TOKENS.value], jnp.int32)
  kwargs = dict(max_new_tokens=_NEW_TOKENS.value, eos_id=None)
  start = time.time()
  result = speclm.autoregressive_decode(model, prompt, lengths, **kwargs)  # compiles
  first_s = time.time() - start
  start = time.time()
  again = speclm.autoregressive_decode(model, prompt, lengths, **kwargs)
  again_s = time.time() - start
  return dict(held=memory.held_bytes(model.params), load_s=load_s, after_load_rss=after_load,
              peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              first_call_s=first_s, decode_s=again_s,
              tokens=np.asarray(result.tokens)[0].tolist(),
              repeated=np.asarray(again.tokens)[0].tolist())


def main(argv):
  del argv
  if _DECODE.value:
    print(json.dumps(decode(_PATH.value)), flush=True)
    return
  from speclm.checkpoints import memory  # pylint: disable=import-outside-toplevel
  if not os.path.exists(_PATH.value):
    start = time.time()
    print(f'writing {_PATH.value} ({_SHAPE.value}, {_QUANT.value}) …', flush=True)
    write(_PATH.value)
    print(f'  {memory.format_bytes(os.path.getsize(_PATH.value))} in'
          f' {time.time() - start:.0f} s', flush=True)
  proc = subprocess.run([sys.executable, __file__, f'--path={_PATH.value}', '--decode',
                         f'--new_tokens={_NEW_TOKENS.value}',
                         f'--prompt_tokens={_PROMPT_TOKENS.value}'],
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    print(proc.stderr[-3000:], file=sys.stderr)
    sys.exit(proc.returncode)
  figures = json.loads(proc.stdout.strip().splitlines()[-1])
  limit = memory.parse_bytes(_MAX_RSS.value)
  size = os.path.getsize(_PATH.value)
  print(f'file: {memory.format_bytes(size)} ({_SHAPE.value}, {_QUANT.value})')
  print(f'weights as held: {memory.format_bytes(figures["held"])}')
  print(f'load: {figures["load_s"]:.1f} s; resident after loading:'
        f' {memory.format_bytes(figures["after_load_rss"])}')
  print(f'decode: {_PROMPT_TOKENS.value}-token prompt + {_NEW_TOKENS.value} tokens, first call'
        f' (compiling) {figures["first_call_s"]:.1f} s, again {figures["decode_s"]:.1f} s'
        f' ({1e3 * figures["decode_s"] / _NEW_TOKENS.value:.0f} ms/token with the prefill)')
  print(f'tokens: {figures["tokens"]}; the same again: {figures["tokens"] == figures["repeated"]}')
  print(f'peak resident memory: {memory.format_bytes(figures["peak_rss"])}'
        f' (limit {memory.format_bytes(limit)}):'
        f' {"within" if figures["peak_rss"] < limit else "OVER"}')
  if figures['peak_rss'] >= limit:
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
