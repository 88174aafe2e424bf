"""GGUF files of every family the reader supports (issue 23): Llama, Mistral, Qwen2, Qwen3,
Gemma 2 and Gemma 3.

For each family a small random Hugging Face model (float32) is written to GGUF as llama.cpp's
converter writes it: its metadata keys, the tensor names of the `gguf` package's own table
(`gguf.get_tensor_name_map`, which the converter uses), the Q/K rows interleaved per head for
the 'llama' architecture only, 1 added to Gemma's norm weights, norms and biases in F32 and
the matrices in F32, F16, Q8_0 and one K-quant per family (Q2_K … Q6_K; the K-quant blocks are
random, with finite float16 scales, and their decoded values become the weights). The HF model
then takes the weights the file decodes to, and `gguf.load_model`'s logits must equal its
logits. Sliding windows are shorter than the sequences, so the masks matter.

K-quant decoding is checked separately, against decoders written here from the block formats.
"""

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip('gguf')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from speclm.checkpoints import gguf as gguf_reader  # pylint: disable=g-import-not-at-top

Q = gguf.GGMLQuantizationType
TOLERANCE = 1e-4
VOCAB = 97
# Rows of 256 values, as K-quants need; the attention width (heads × head_dim) too.
SIZES = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=64)
# family -> (GGUF architecture, HF class, HF config class, layers, K-quant, HF settings)
FAMILIES = {
    'llama': ('llama', 'LlamaForCausalLM', 'LlamaConfig', 2, 'Q4_K', dict(rope_theta=500.0)),
    'mistral': ('llama', 'MistralForCausalLM', 'MistralConfig', 2, 'Q2_K',
                dict(sliding_window=4, tie_word_embeddings=True)),
    'qwen2': ('qwen2', 'Qwen2ForCausalLM', 'Qwen2Config', 2, 'Q5_K', dict(rope_theta=1e6)),
    'qwen3': ('qwen3', 'Qwen3ForCausalLM', 'Qwen3Config', 2, 'Q6_K',
              dict(tie_word_embeddings=True)),
    'gemma2': ('gemma2', 'Gemma2ForCausalLM', 'Gemma2Config', 2, 'Q3_K',
               dict(sliding_window=4, query_pre_attn_scalar=64, attn_logit_softcapping=5.0,
                    final_logit_softcapping=8.0)),
    # Six layers: llama.cpp's Gemma 3 has five sliding layers before each global one.
    'gemma3': ('gemma3', 'Gemma3ForCausalLM', 'Gemma3TextConfig', 6, 'Q4_K',
               dict(sliding_window=4, query_pre_attn_scalar=64, final_logit_softcapping=8.0,
                    rope_scaling=dict(rope_type='linear', factor=2.0))),
}
# The type of each HF matrix ('K' is the family's K-quant); 1-D tensors stay F32, as in
# llama.cpp's files.
MATRIX_TYPES = {'embed_tokens': 'K', 'lm_head': 'Q8_0', 'q_proj': 'Q8_0', 'k_proj': 'K',
                'v_proj': 'F32', 'o_proj': 'Q8_0', 'gate_proj': 'K', 'up_proj': 'F16',
                'down_proj': 'K'}
# Byte offsets of each K-quant block's float16 scales: d, and dmin where there is one (values
# are d·scale·q − dmin·min), with dmin / d = the mean q, so that the weights average about 0.
K_SCALES = {'Q2_K': {80: 1.0, 82: 1.5}, 'Q3_K': {108: 1.0}, 'Q4_K': {0: 1.0, 2: 7.5},
            'Q5_K': {0: 1.0, 2: 15.5}, 'Q6_K': {208: 1.0}}


# ----------------------------------------------------------------------------------------------
# Writing a HF model as llama.cpp's converter would


def _interleaved_rows(heads: int, head_dim: int) -> np.ndarray:
  """The converter's Q/K row order for the 'llama' architecture: within each head, row 2j is
  HF's row j and row 2j + 1 HF's row head_dim/2 + j."""
  half = head_dim // 2
  return np.array([h * head_dim + j + half * second for h in range(heads)
                   for j in range(half) for second in (0, 1)])


def _random_k_blocks(kind: str, shape: tuple[int, int], rng, peak: float = 0.15) -> np.ndarray:
  """Random blocks of a K-quant for a `[rows, cols]` matrix (uint8 `[rows, bytes]`), scaled so
  that the largest decoded value is about `peak`."""
  rows, cols = shape
  block_size, type_size = gguf.GGML_QUANT_SIZES[Q[kind]]
  raw = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
  jitter = rng.uniform(0.5, 1.0, len(raw))

  def set_scales(scale):
    for offset, ratio in K_SCALES[kind].items():
      raw[:, offset:offset + 2] = (scale * ratio * jitter).astype(np.float16).view(
          np.uint8).reshape(-1, 2)

  set_scales(1.0)
  set_scales(peak / np.abs(gguf.quants.dequantize(raw, Q[kind])).max())
  return raw.reshape(rows, -1)


def _encode(w: np.ndarray, kind: str, rng):
  """(what GGUFWriter.add_tensor takes, the float32 values the file decodes to)."""
  if kind == 'F32':
    return w, w
  if kind == 'F16':
    return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
  raw = (gguf.quants.quantize(w, Q[kind]) if kind == 'Q8_0'
         else _random_k_blocks(kind, w.shape, rng))
  return (raw, Q[kind]), gguf.quants.dequantize(raw, Q[kind]).reshape(w.shape)


def _write_metadata(writer, arch: str, c) -> None:
  """The keys llama.cpp's converter writes for `arch` (plus Mistral's window)."""
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  rope = c.rope_parameters.get('full_attention', c.rope_parameters)
  if arch != 'gemma2':  # the Gemma 2 converter leaves the base at llama.cpp's 10000
    writer.add_rope_freq_base(rope['rope_theta'])
  if rope.get('rope_type') == 'linear':
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope['factor'])
  if arch == 'llama':
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.head_dim)
  else:
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
  if arch in ('llama', 'gemma2', 'gemma3') and getattr(c, 'sliding_window', None):
    writer.add_sliding_window(c.sliding_window)
  if getattr(c, 'attn_logit_softcapping', None):
    writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
  if getattr(c, 'final_logit_softcapping', None):
    writer.add_final_logit_softcapping(c.final_logit_softcapping)


def _export(path, family: str, seed: int = 0):
  """A random HF model of `family` written to `path` as GGUF; returns the HF model holding the
  weights the file decodes to."""
  arch, class_name, config_name, num_layers, kquant, settings = FAMILIES[family]
  config = getattr(transformers, config_name)(**SIZES, num_hidden_layers=num_layers, **settings)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access  # Gemma's soft-cap
  torch.manual_seed(seed)
  model = getattr(transformers, class_name)(config).float().eval()
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
  rng = np.random.default_rng(seed)
  writer = gguf.GGUFWriter(str(path), arch)
  _write_metadata(writer, arch, config)
  decoded = {}
  for hf_name, param in model.state_dict().items():
    if hf_name == 'lm_head.weight' and config.tie_word_embeddings:
      continue
    w = rng.normal(0.0, 0.06, param.shape).astype(np.float32)
    if hf_name.endswith('norm.weight') and not arch.startswith('gemma'):
      w += 1.0  # RMSNorm scales around 1 (Gemma's w is around 0: it scales by 1 + w)
    rows = np.arange(w.shape[0])
    if arch == 'llama' and hf_name.endswith(('q_proj.weight', 'k_proj.weight')):
      heads = config.num_attention_heads if 'q_proj' in hf_name else config.num_key_value_heads
      rows = _interleaved_rows(heads, config.head_dim)
    stored = w[rows] + (1.0 if arch.startswith('gemma') and 'norm' in hf_name else 0.0)
    kind = MATRIX_TYPES[hf_name.split('.')[-2]] if w.ndim == 2 else 'F32'
    value, values = _encode(np.ascontiguousarray(stored, np.float32),
                            kquant if kind == 'K' else kind, rng)
    raw, raw_dtype = value if isinstance(value, tuple) else (value, None)
    writer.add_tensor(names.get_name(hf_name, try_suffixes=('.weight', '.bias')), raw,
                      raw_dtype=raw_dtype)
    if arch.startswith('gemma') and 'norm' in hf_name:
      values = values - np.float32(1.0)
    decoded[hf_name] = torch.from_numpy(np.ascontiguousarray(values[np.argsort(rows)]))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  missing, unexpected = model.load_state_dict(decoded, strict=False)
  assert not unexpected and set(missing) <= {'lm_head.weight'}
  if config.tie_word_embeddings:
    model.tie_weights()
  return model


# ----------------------------------------------------------------------------------------------
# Whole models


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_logits_equal_hugging_face_on_the_dequantized_weights(tmp_path, family):
  hf_model = _export(tmp_path / 'm.gguf', family)
  file = gguf_reader.open_gguf(tmp_path / 'm.gguf')
  kinds = {Q(t.tensor_type).name for t in file.tensors.values()}
  assert {'F32', 'F16', 'Q8_0', FAMILIES[family][4]} <= kinds
  model = gguf_reader.load_model(file)
  c = model.definition.config
  assert c.family == family and c.vocab_size == VOCAB and c.max_position_embeddings == 64
  assert c.tie_embeddings == hf_model.config.tie_word_embeddings
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
  ours = np.asarray(jax.jit(model.definition.forward)(model.params, jnp.asarray(tokens,
                                                                                jnp.int32)))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert np.abs(theirs).max() > 0.5  # logits that say something
  np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_matrices_kept_quantized_give_the_same_logits(tmp_path, family, caplog):
  """`load_model(quantized=True)`: the Q8_0 and Q4_K/Q5_K/Q6_K matrices stay as stored (no
  float copy) and the logits equal Hugging Face's on the decoded weights; the K-quants the
  kernel lacks (Mistral's Q2_K, Gemma 2's Q3_K) are widened to float32, said in one line."""
  from speclm.kernels import quantized  # pylint: disable=g-import-not-at-top
  if not quantized.available():
    pytest.skip('CPU kernel unavailable')
  hf_model = _export(tmp_path / 'm.gguf', family)
  kquant = FAMILIES[family][4]
  with caplog.at_level('WARNING'):
    model = gguf_reader.load_model(tmp_path / 'm.gguf', quantized=True)
  layer = model.params['layers_0']
  # Names as held: the file's format, '_x16' where the rows load interleaved (VNNI machines).
  names = lambda params: {quantized.file_format(k) for k in params}
  assert names(layer['attention']['query']) - {'bias'} == {'Q8_0'}  # no float kernel beside
  assert set(layer['attention']['value']) - {'bias'} == {'kernel'}  # F32 in the file
  assert set(layer['mlp']['up']) == {'kernel'}  # F16 in the file
  widened = [r.getMessage() for r in caplog.records if 'no quantized kernel' in r.getMessage()]
  if kquant in quantized.FORMATS:
    assert names(layer['mlp']['down']) == {kquant} == names(model.params['embedder'])
    assert not widened
  else:
    assert set(layer['mlp']['down']) == {'kernel'}
    assert len(widened) == 1 and f' {kquant} matrices have no quantized kernel' in widened[0]
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
  ours = np.asarray(jax.jit(model.definition.forward)(model.params, jnp.asarray(tokens,
                                                                                jnp.int32)))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)


def test_family_switches_from_metadata(tmp_path):
  """What each architecture's metadata turns into (the configs of the files above)."""
  configs = {}
  for family in ('mistral', 'gemma2', 'gemma3'):
    _export(tmp_path / f'{family}.gguf', family)
    configs[family] = gguf_reader.read_config(tmp_path / f'{family}.gguf')
  assert configs['mistral'].sliding_window == 4 and configs['mistral'].layer_types is None
  gemma2, gemma3 = configs['gemma2'], configs['gemma3']
  assert gemma2.layer_types == ('sliding', 'full')
  assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (5.0, 8.0)
  assert gemma3.layer_types == ('sliding',) * 5 + ('full',)
  assert gemma3.local_rope_theta == 10_000.0 and gemma3.rope_theta == 1e6
  assert gemma3.rope_scaling.kind == 'linear' and gemma3.rope_scaling.factor == 2.0
  assert gemma3.attn_logit_softcap is None and gemma3.final_logit_softcap == 8.0
  for c in (gemma2, gemma3):
    assert c.norm_offset == 1.0 and c.post_norms and c.activation == 'gelu_tanh'
    assert c.query_pre_attn_scalar == 64.0  # the head size


def _metadata_only(path, arch, **keys):
  """A GGUF file with `keys` (under `{arch}.`) and a token embedding only."""
  writer = gguf.GGUFWriter(str(path), arch)
  for key, value in keys.items():
    add = writer.add_uint32 if isinstance(value, int) else writer.add_float32
    add(f'{arch}.{key}', value)
  writer.add_tensor('token_embd.weight', np.zeros((8, keys['embedding_length']), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize('arch,layers_27b', [('gemma2', 46), ('gemma3', 62)])
def test_gemma_query_scale_and_defaults(tmp_path, arch, layers_27b):
  """llama.cpp's rules for what Gemma files leave out: the query scale is the head size but
  for the 27B models (embedding_length / head_count); Gemma 2's window 4096 and caps 50/30;
  Gemma 3 without a window has no sliding layers."""
  sizes = dict(embedding_length=512, feed_forward_length=64, **{'attention.head_count': 4,
                                                                'attention.key_length': 96,
                                                                'attention.value_length': 96})
  for layers, scalar in ((layers_27b - 2, 96.0), (layers_27b, 128.0)):
    _metadata_only(tmp_path / 'g.gguf', arch, block_count=layers, **sizes)
    c = gguf_reader.read_config(tmp_path / 'g.gguf')
    assert c.query_pre_attn_scalar == scalar and c.head_dim == 96
  if arch == 'gemma2':
    assert (c.sliding_window, c.attn_logit_softcap, c.final_logit_softcap) == (4096, 50.0, 30.0)
    assert c.layer_types[:4] == ('sliding', 'full', 'sliding', 'full')
  else:
    assert c.sliding_window is None and c.layer_types is None and c.final_logit_softcap is None
  # A sliding-window pattern in the file replaces llama.cpp's constant.
  _metadata_only(tmp_path / 'p.gguf', arch, block_count=6, **sizes,
                 **{'attention.sliding_window': 8, 'attention.sliding_window_pattern': 3})
  assert gguf_reader.read_config(tmp_path / 'p.gguf').layer_types == ('sliding', 'sliding',
                                                                      'full') * 2


# ----------------------------------------------------------------------------------------------
# K-quant blocks, decoded by hand from ggml's block formats (256 values per block)


def _f16(raw: bytes, at: int) -> float:
  return struct.unpack('<e', raw[at:at + 2])[0]


def _decode_q4_k(block: bytes) -> list[float]:
  """Q4_K: d, dmin (float16), 12 bytes packing 8 six-bit (scale, min) pairs, 128 bytes of
  nibbles; each 64 values use pair 2k on the low nibbles of 32 bytes, pair 2k+1 on the high."""
  d, dmin, s, q = _f16(block, 0), _f16(block, 2), block[4:16], block[16:]

  def pair(j):
    if j < 4:
      return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)

  out = []
  for k in range(4):
    chunk = q[32 * k:32 * (k + 1)]
    for j, shift in ((2 * k, 0), (2 * k + 1, 4)):
      scale, minimum = pair(j)
      out += [d * scale * ((b >> shift) & 0xF) - dmin * minimum for b in chunk]
  return out


def _decode_q6_k(block: bytes) -> list[float]:
  """Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16
  values), d (float16). Each 128 values take 64 low and 32 high bytes: value 32k + i (k < 4,
  i < 32) has low nibble k // 2 of byte i + 32 (k % 2) and high bits 2k of byte i; the
  6-bit result is offset by 32."""
  ql, qh, d = block[:128], block[128:192], _f16(block, 208)
  scales = struct.unpack('<16b', block[192:208])
  out = []
  for half in range(2):
    low, high, sc = ql[64 * half:], qh[32 * half:], scales[8 * half:]
    for k in range(4):
      for i in range(32):
        q = ((low[i + 32 * (k % 2)] >> (4 * (k // 2))) & 0xF) | (((high[i] >> (2 * k)) & 3) << 4)
        out.append(d * sc[i // 16 + 2 * k] * (q - 32))
  return out


def _read_back(path, raw, kind):
  """`raw` blocks of type `kind` written as tensor 'w' of a GGUF file, read by our reader."""
  writer = gguf.GGUFWriter(str(path), 'llama')
  writer.add_tensor('w', raw, raw_dtype=Q[kind])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return gguf_reader.open_gguf(path).tensor('w')


@pytest.mark.parametrize('kind,decode', [('Q4_K', _decode_q4_k), ('Q6_K', _decode_q6_k)])
def test_k_quant_blocks_match_format(tmp_path, kind, decode):
  raw = _random_k_blocks(kind, (2, 512), np.random.default_rng(2))
  got = _read_back(tmp_path / 'k.gguf', raw, kind)
  size = gguf.GGML_QUANT_SIZES[Q[kind]][1]
  flat = raw.tobytes()
  want = [v for at in range(0, len(flat), size) for v in decode(flat[at:at + size])]
  assert got.shape == (2, 512) and got.dtype == np.float32
  np.testing.assert_allclose(got.ravel(), np.array(want, np.float32), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize('kind', gguf_reader.SUPPORTED_TYPES)
def test_every_supported_type_is_read(tmp_path, kind):
  """Each listed type decodes (zero blocks decode to zeros) with the right shape."""
  block_size, type_size = gguf.GGML_QUANT_SIZES[Q[kind]]
  raw = np.zeros((3, 256 // block_size * type_size), np.uint8)
  got = _read_back(tmp_path / 't.gguf', raw, kind)
  assert got.shape == (3, 256) and got.dtype == np.float32
  np.testing.assert_array_equal(got, 0.0)


# ----------------------------------------------------------------------------------------------
# Refusals


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
  _metadata_only(tmp_path / 'p.gguf', 'phi3', embedding_length=8)
  with pytest.raises(ValueError, match="'phi3' model; speclm reads GGUF architectures llama,"
                     ' qwen2, qwen3, gemma2, gemma3'):
    gguf_reader.load_model(tmp_path / 'p.gguf')


def test_unsupported_type_lists_the_supported_ones(tmp_path):
  writer = gguf.GGUFWriter(str(tmp_path / 'q.gguf'), 'llama')
  writer.add_tensor('w', np.zeros((2, 292), np.uint8), raw_dtype=Q.Q8_K)  # one Q8_K block/row
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match='Q8_K, which speclm does not read; supported types are '
                     + ', '.join(gguf_reader.SUPPORTED_TYPES) + r'\.'):
    gguf_reader.open_gguf(tmp_path / 'q.gguf').tensor('w')


def test_tensors_of_another_family_are_refused(tmp_path):
  """Qwen2's biases in a 'llama' file (or any tensor the family lacks) are not dropped."""
  _export(tmp_path / 'm.gguf', 'qwen2')
  data = (tmp_path / 'm.gguf').read_bytes()
  (tmp_path / 'l.gguf').write_bytes(data.replace(b'qwen2', b'llama'))  # keys and name
  with pytest.raises(ValueError,
                     match=r"tensors a llama model does not use: \['blk.0.attn_k.bias'"):
    gguf_reader.load_model(tmp_path / 'l.gguf')
