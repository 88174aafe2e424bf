"""The GGUF reader: dequantization, llama.cpp's Q/K row order, names, config and errors.

Files are written with the `gguf` package's writer into tmp directories; block decoding is
checked against a byte-level decoder written here from the format's definition, not against
the `gguf` package the reader itself uses.
"""

import dataclasses
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip('gguf')

from speclm import trees  # pylint: disable=g-import-not-at-top
from speclm.checkpoints import gguf as gguf_reader  # pylint: disable=g-import-not-at-top
from speclm.models import llama  # pylint: disable=g-import-not-at-top

Q = gguf.GGMLQuantizationType


# ----------------------------------------------------------------------------------------------
# Block formats, decoded by hand (32 values per block; nibbles: the low halves hold values
# 0..15, the high halves 16..31).


def _decode_blocks(raw: bytes, kind: str) -> np.ndarray:
  values = []
  size = {'Q4_0': 18, 'Q4_1': 20, 'Q8_0': 34}[kind]
  for start in range(0, len(raw), size):
    block = raw[start:start + size]
    d = struct.unpack('<e', block[:2])[0]
    if kind == 'Q8_0':
      values += [d * q for q in struct.unpack('<32b', block[2:])]
      continue
    m, packed = (struct.unpack('<e', block[2:4])[0], block[4:]) if kind == 'Q4_1' else (
        None, block[2:])
    nibbles = [b & 0xF for b in packed] + [b >> 4 for b in packed]
    values += [d * q + m for q in nibbles] if kind == 'Q4_1' else [d * (q - 8) for q in nibbles]
  return np.array(values, np.float32)


def _random_blocks(kind: str, num_blocks: int, rng) -> bytes:
  out = b''
  for _ in range(num_blocks):
    d = struct.pack('<e', rng.uniform(-0.1, 0.1))
    if kind == 'Q8_0':
      out += d + rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
    elif kind == 'Q4_1':
      out += d + struct.pack('<e', rng.uniform(-1, 1)) + rng.integers(0, 256, 16,
                                                                       dtype=np.uint8).tobytes()
    else:
      out += d + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
  return out


def _write(path, tensors, *, arch='llama', metadata=None, configure=None):
  """Writes a GGUF file; `tensors` maps names to float arrays or (uint8 blocks, type) pairs."""
  writer = gguf.GGUFWriter(str(path), arch)
  if configure is not None:
    configure(writer)
  for key, value in (metadata or {}).items():
    if isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    elif isinstance(value, float):
      writer.add_float32(key, value)
    else:
      writer.add_string(key, value)
  for name, value in tensors.items():
    if isinstance(value, tuple):
      writer.add_tensor(name, value[0], raw_dtype=value[1])
    else:
      writer.add_tensor(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize('kind', ['Q4_0', 'Q4_1', 'Q8_0'])
def test_block_dequantization_matches_format(tmp_path, kind):
  rng = np.random.default_rng(0)
  rows, cols = 3, 64
  raw = _random_blocks(kind, rows * cols // 32, rng)
  data = np.frombuffer(raw, np.uint8).reshape(rows, -1)
  _write(tmp_path / 'q.gguf', {'w': (data, Q[kind])})
  got = gguf_reader.open_gguf(tmp_path / 'q.gguf').tensor('w')
  assert got.shape == (rows, cols) and got.dtype == np.float32
  np.testing.assert_array_equal(got, _decode_blocks(raw, kind).reshape(rows, cols))


def test_float_tensors(tmp_path):
  rng = np.random.default_rng(1)
  f32 = rng.normal(size=(4, 6)).astype(np.float32)
  f16 = rng.normal(size=(5,)).astype(np.float16)
  bf16 = (f32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # exact in bfloat16
  raw_bf16 = (bf16.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(4, 12)
  _write(tmp_path / 'f.gguf', {'a': f32, 'b': f16, 'c': (raw_bf16, Q.BF16)})
  file = gguf_reader.open_gguf(tmp_path / 'f.gguf')
  np.testing.assert_array_equal(file.tensor('a'), f32)
  np.testing.assert_array_equal(file.tensor('b'), f16.astype(np.float32))
  np.testing.assert_array_equal(file.tensor('c'), bf16)


def test_quantize_round_trip_is_close(tmp_path):
  """Quantized by the gguf package, dequantized by us: within each format's step size."""
  w = np.random.default_rng(2).normal(size=(8, 64)).astype(np.float32)
  for kind, tolerance in (('Q8_0', 0.02), ('Q5_1', 0.12), ('Q5_0', 0.18), ('Q4_1', 0.25),
                          ('Q4_0', 0.35)):
    _write(tmp_path / f'{kind}.gguf', {'w': (gguf.quants.quantize(w, Q[kind]), Q[kind])})
    got = gguf_reader.open_gguf(tmp_path / f'{kind}.gguf').tensor('w')
    assert np.max(np.abs(got - w)) < tolerance, kind


# ----------------------------------------------------------------------------------------------
# llama.cpp's Q/K row order


def _llamacpp_permute(w, heads):
  """The converter's reordering, written from its definition: within each head, the rows of
  the first half and of the second half are interleaved (0, H/2, 1, H/2 + 1, …)."""
  head_dim = w.shape[0] // heads
  out = np.empty_like(w)
  for h in range(heads):
    for i in range(head_dim // 2):
      out[h * head_dim + 2 * i] = w[h * head_dim + i]
      out[h * head_dim + 2 * i + 1] = w[h * head_dim + head_dim // 2 + i]
  return out


def _rope_adjacent(x, position, theta):
  """llama.cpp's RoPE on one head: rotates pairs (x0, x1), (x2, x3), …"""
  h = x.shape[0]
  out = x.copy()
  for i in range(h // 2):
    angle = position * theta ** (-2 * i / h)
    a, b = x[2 * i], x[2 * i + 1]
    out[2 * i], out[2 * i + 1] = a * np.cos(angle) - b * np.sin(angle), a * np.sin(
        angle) + b * np.cos(angle)
  return out


def test_unpermute_restores_rotate_half_layout():
  rng = np.random.default_rng(3)
  heads, head_dim, width = 3, 8, 5
  w_hf = rng.normal(size=(heads * head_dim, width))
  w_gguf = _llamacpp_permute(w_hf, heads)
  np.testing.assert_array_equal(gguf_reader.unpermute_rows(w_gguf, heads), w_hf)
  np.testing.assert_array_equal(gguf_reader.permute_rows(w_hf, heads), w_gguf)
  # Attention scores are what matter: llama.cpp's pairwise RoPE on its layout gives the same
  # q·k as our rotate-half RoPE on the restored layout.
  x, y = rng.normal(size=width), rng.normal(size=width)
  inv_freq = 1.0 / (10_000.0 ** (np.arange(0, head_dim, 2) / head_dim))
  ours_q = np.asarray(llama.apply_rope(
      jnp.asarray((w_hf @ x).reshape(1, 1, heads, head_dim), jnp.float32),
      jnp.array([[7]]), inv_freq.astype(np.float32)))[0, 0]
  ours_k = np.asarray(llama.apply_rope(
      jnp.asarray((w_hf @ y).reshape(1, 1, heads, head_dim), jnp.float32),
      jnp.array([[2]]), inv_freq.astype(np.float32)))[0, 0]
  for h in range(heads):
    rows = slice(h * head_dim, (h + 1) * head_dim)
    cpp_q = _rope_adjacent((w_gguf @ x)[rows], 7, 10_000.0)
    cpp_k = _rope_adjacent((w_gguf @ y)[rows], 2, 10_000.0)
    np.testing.assert_allclose(cpp_q @ cpp_k, ours_q[h] @ ours_k[h], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Whole models


def _metadata(config: llama.LlamaConfig, context_length=128):
  out = {
      'llama.block_count': config.num_layers,
      'llama.context_length': context_length,
      'llama.embedding_length': config.embed_dim,
      'llama.feed_forward_length': config.mlp_dim,
      'llama.attention.head_count': config.num_heads,
      'llama.attention.head_count_kv': config.num_kv_heads,
      'llama.rope.freq_base': float(config.rope_theta),
      'llama.attention.layer_norm_rms_epsilon': float(config.norm_eps),
      'llama.vocab_size': config.vocab_size,
  }
  return {k: v for k, v in out.items() if v is not None}


def _export(model, path, quant=None):
  """Writes our Llama params as llama.cpp would lay them out ([out, in], permuted Q/K)."""
  c, p = model.definition.config, model.params
  d = c.embed_dim
  tensors = {'token_embd.weight': np.asarray(p['embedder']['embedding']),
             'output_norm.weight': np.asarray(p['final_norm']['scale'])}
  if not c.tie_embeddings:
    tensors['output.weight'] = np.asarray(p['lm_head']['kernel']).T
  for i in range(c.num_layers):
    layer = p[f'layers_{i}']
    attn = {k: np.asarray(v['kernel']) for k, v in layer['attention'].items()}
    mats = {
        'attn_q': _llamacpp_permute(attn['query'].reshape(d, -1).T, c.num_heads),
        'attn_k': _llamacpp_permute(attn['key'].reshape(d, -1).T, c.num_kv_heads),
        'attn_v': attn['value'].reshape(d, -1).T,
        'attn_output': attn['out'].reshape(-1, d).T,
        'ffn_gate': np.asarray(layer['mlp']['gate']['kernel']).T,
        'ffn_up': np.asarray(layer['mlp']['up']['kernel']).T,
        'ffn_down': np.asarray(layer['mlp']['down']['kernel']).T,
    }
    for name, w in mats.items():
      w = np.ascontiguousarray(w, np.float32)
      tensors[f'blk.{i}.{name}.weight'] = ((gguf.quants.quantize(w, Q[quant]), Q[quant])
                                           if quant else w)
    tensors[f'blk.{i}.attn_norm.weight'] = np.asarray(layer['pre_attention_norm']['scale'])
    tensors[f'blk.{i}.ffn_norm.weight'] = np.asarray(layer['pre_mlp_norm']['scale'])
  _write(path, tensors, metadata=_metadata(c, c.max_position_embeddings))


@pytest.mark.parametrize('tied', [True, False])
def test_llama_round_trip_is_exact(tmp_path, tied):
  model = llama.random_model(vocab_size=50, embed_dim=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, mlp_dim=96, tie_embeddings=tied, seed=4)
  model = dataclasses.replace(model, definition=llama.Llama(dataclasses.replace(
      model.definition.config, max_position_embeddings=96)))
  _export(model, tmp_path / 'm.gguf')  # llama.context_length = 96
  loaded = gguf_reader.load_model(tmp_path / 'm.gguf')
  config, want_config = loaded.definition.config, model.definition.config
  np.testing.assert_allclose(config.norm_eps, want_config.norm_eps, rtol=1e-6)  # stored as f32
  assert dataclasses.replace(config, norm_eps=want_config.norm_eps) == want_config
  assert config.tie_embeddings == tied
  assert config.max_position_embeddings == 96 and loaded.definition.max_context_length == 96
  flat = lambda tree: {k: np.asarray(v) for k, v in trees.flatten(tree).items()}
  want, got = flat(model.params), flat(loaded.params)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_quantized_llama_stays_close(tmp_path):
  model = llama.random_model(vocab_size=50, embed_dim=64, num_layers=2, seed=5)
  _export(model, tmp_path / 'm.gguf', quant='Q8_0')
  loaded = gguf_reader.load_model(tmp_path / 'm.gguf')
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 12)), jnp.int32)
  forward = jax.jit(model.definition.forward)
  ours, theirs = np.asarray(forward(model.params, tokens)), np.asarray(forward(loaded.params,
                                                                               tokens))
  # Q8_0 keeps about 2-3 significant digits per weight; logits here are O(1).
  assert np.max(np.abs(ours - theirs)) < 0.02 * np.max(np.abs(ours)) + 0.1


@pytest.mark.parametrize('quant', ['Q8_0', 'Q4_1'])
def test_quantized_target_and_draft_decode_greedily_as_the_baseline(tmp_path, quant):
  """Target and draft both loaded with `quantized=True` (their matrices multiplied as stored):
  greedy speculative output equals the target's baseline token for token."""
  import speclm  # pylint: disable=g-import-not-at-top
  from speclm.kernels import quantized  # pylint: disable=g-import-not-at-top
  if not quantized.available():
    pytest.skip('CPU kernel unavailable')
  target = llama.random_model(vocab_size=64, embed_dim=64, num_layers=2, mlp_dim=128, seed=7)
  draft = llama.random_model(vocab_size=64, embed_dim=64, num_layers=1, mlp_dim=64, seed=8)
  _export(target, tmp_path / 't.gguf', quant=quant)
  _export(draft, tmp_path / 'd.gguf', quant=quant)
  target = gguf_reader.load_model(tmp_path / 't.gguf', quantized=True)
  draft = gguf_reader.load_model(tmp_path / 'd.gguf', quantized=True)
  # '_x16': interleaved, where the integer route reads them (every matrix here has 16k rows).
  held = quant + quantized.SUFFIX if quantized.interleaving() else quant
  assert set(target.params['layers_1']['mlp']['gate']) == {held}
  assert set(draft.params['layers_0']['attention']['query']) == {held}
  prompts = jnp.asarray(np.random.default_rng(3).integers(1, 64, (3, 6)), jnp.int32)
  lengths = jnp.asarray([6, 3, 5], jnp.int32)
  baseline = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=12)
  for gamma in (1, 4):
    result = speclm.speculative_decode(target, draft, prompts, lengths, gamma=gamma,
                                       max_new_tokens=12)
    assert result.to_lists() == baseline.to_lists(), gamma


def test_context_length_absent_is_none(tmp_path):
  model = llama.random_model(vocab_size=50, embed_dim=32, num_layers=1, seed=1)
  assert model.definition.max_context_length is None
  _export(model, tmp_path / 'm.gguf')  # max_position_embeddings None: no context_length key
  assert 'llama.context_length' not in gguf_reader.open_gguf(tmp_path / 'm.gguf').metadata
  assert gguf_reader.read_config(tmp_path / 'm.gguf').max_position_embeddings is None


# ----------------------------------------------------------------------------------------------
# Errors


def test_nan_or_inf_weights_are_refused(tmp_path):
  model = llama.random_model(vocab_size=50, embed_dim=32, num_layers=2, seed=2)
  params = jax.tree_util.tree_map(np.array, model.params)
  params['layers_1']['mlp']['up']['kernel'][[0, 5, 9], 3] = [np.nan, np.inf, -np.inf]
  _export(dataclasses.replace(model, params=params), tmp_path / 'm.gguf')
  path = str(tmp_path / 'm.gguf')
  with pytest.raises(ValueError, match=re.escape(
      f"Parameter 'layers_1/mlp/up/kernel' in {path} has 3 NaN/Inf values (of 2048); the"
      ' checkpoint is corrupt.')):
    gguf_reader.load_model(path)


def test_unsupported_architecture(tmp_path):
  _write(tmp_path / 'g.gguf', {'token_embd.weight': np.zeros((4, 8), np.float32)}, arch='gpt2')
  with pytest.raises(ValueError, match="'gpt2' model"):
    gguf_reader.load_model(tmp_path / 'g.gguf')


def test_unsupported_quantization(tmp_path):
  # Q8_1: llama.cpp's intermediate type for dot products, which no model file holds.
  _write(tmp_path / 'q.gguf', {'w': (np.zeros((2, 40), np.uint8), Q.Q8_1)})
  with pytest.raises(ValueError, match='Q8_1.*supported types are F32, F16, BF16, Q4_0, Q4_1'):
    gguf_reader.open_gguf(tmp_path / 'q.gguf').tensor('w')


def test_missing_and_corrupt_files(tmp_path):
  with pytest.raises(FileNotFoundError):
    gguf_reader.load_model(tmp_path / 'absent.gguf')
  (tmp_path / 'bad.gguf').write_bytes(b'GGUF' + b'\x00' * 5)
  with pytest.raises(ValueError, match='not a readable GGUF'):
    gguf_reader.load_model(tmp_path / 'bad.gguf')


def test_missing_metadata(tmp_path):
  _write(tmp_path / 'm.gguf', {'token_embd.weight': np.zeros((4, 8), np.float32)},
         metadata={'llama.embedding_length': 8})
  with pytest.raises(ValueError, match='llama.attention.head_count'):
    gguf_reader.read_config(tmp_path / 'm.gguf')


def test_one_pass_metadata_reader_reads_what_the_package_reads(tmp_path):
  """`gguf_reader.FastGGUFReader` (arrays in one pass) against `gguf.GGUFReader`: every field's
  types and contents, the tensors' offsets, on arrays of strings (empty and non-ASCII ones
  too), of booleans and number types, and a nested one (the package's own code)."""
  from speclm.checkpoints import gguf_reader as one_pass  # pylint: disable=g-import-not-at-top

  def configure(writer):
    writer.add_array('test.strings', ['', 'a', 'héllo wörld', 'x' * 300, '\u2581tok'])
    writer.add_array('test.nested', [[1, 2], [3]])
    writer.add_array('test.bools', [True, False, True])
    for name, kind in (('u8', gguf.GGUFValueType.UINT8), ('i32', gguf.GGUFValueType.INT32),
                       ('u64', gguf.GGUFValueType.UINT64), ('f32', gguf.GGUFValueType.FLOAT32),
                       ('f64', gguf.GGUFValueType.FLOAT64)):
      writer.add_key_value(f'test.{name}', [1, 2, 250], gguf.GGUFValueType.ARRAY,
                           sub_type=kind)
    writer.add_token_merges(['h e', 'he l'])

  path = tmp_path / 'fields.gguf'
  _write(path, {'a': np.ones((3, 8), np.float32), 'b': np.zeros((5,), np.float32)},
         metadata={'test.scalar': 7, 'test.text': 'plain'}, configure=configure)
  reference = gguf.GGUFReader(str(path), 'r')
  fast = one_pass.fast_reader_class()(str(path), 'r')
  assert list(fast.fields) == list(reference.fields)
  for key, field in reference.fields.items():
    assert fast.fields[key].types == field.types, key
    assert fast.fields[key].contents() == field.contents(), key
  assert fast.fields['test.strings'].contents()[2] == 'héllo wörld'
  assert fast.fields['test.f64'].contents() == [1.0, 2.0, 250.0]
  assert [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors] == [
      (t.name, t.data_offset, t.n_bytes) for t in reference.tensors]
  np.testing.assert_array_equal(np.asarray(fast.tensors[0].data), reference.tensors[0].data)
  # `open_gguf` reads through it: the metadata keeps the small arrays, `array` the large ones.
  opened = gguf_reader.open_gguf(path)
  assert opened.metadata['test.u8'] == [1, 2, 250]
  assert opened.array('tokenizer.ggml.merges') == ['h e', 'he l']


# ----------------------------------------------------------------------------------------------
# Tokenizer metadata


def _tokenizer_file(path, *, model='gpt2', pre='smollm'):
  """A GGUF file with a tiny byte-level BPE vocabulary: specials, 256 byte symbols, 'hello'."""
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tokens = ['<s>', '</s>'] + alphabet + ['he', 'hel', 'hell', 'hello']
  types = [3, 3] + [1] * (len(tokens) - 2)
  template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
              "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")

  def configure(writer):
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(['h e', 'he l', 'hel l', 'hell o'])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(template)

  _write(path, {'token_embd.weight': np.zeros((len(tokens), 8), np.float32)},
         configure=configure)
  return tokens


def test_tokenizer_from_gguf_metadata(tmp_path):
  vocab = _tokenizer_file(tmp_path / 't.gguf')
  tok = gguf_reader.load_tokenizer(tmp_path / 't.gguf')
  assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (0, 1, True, len(vocab))
  ids = tok.encode('hello 42 héllo')
  assert ids[0] == 0 and ids[1] == vocab.index('hello')  # BOS added, merges applied
  assert tok.decode(ids) == 'hello 42 héllo'
  assert tok.encode('<s>hello', add_bos=False) == [0, vocab.index('hello')]  # specials whole
  assert tok.render_chat('hi') == '<s>[user] hi</s>[assistant] '
  assert tok.encode_chat('hi')[:2] == [0, vocab.index('[')]  # the template's BOS, not a second


@pytest.mark.parametrize('pre,pieces', [
    ('qwen2', ['1', '2', '3', '4', ' apples', ',\n', ' ', ' done']),  # Qwen2/2.5/3: digits alone
    ('llama-bpe', ['123', '4', ' apples', ',\n', ' ', ' done']),  # Llama 3: groups of three
])
def test_pre_tokenizers_split_like_llama_cpp(tmp_path, pre, pieces):
  _tokenizer_file(tmp_path / 't.gguf', pre=pre)
  tok = gguf_reader.load_tokenizer(tmp_path / 't.gguf')
  text = '1234 apples,\n  done'
  assert tok.decode(tok.encode(text)) == text
  split = [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
  byte_level = str.maketrans({'Ġ': ' ', 'Ċ': '\n'})  # GPT-2's byte symbols for space, newline
  assert [piece.translate(byte_level) for piece in split] == pieces


@pytest.mark.parametrize('add_space_prefix', [True, False])  # Llama 2 / Gemma
def test_sentencepiece_tokenizer_equals_sentencepiece(tmp_path, add_space_prefix):
  """A SentencePiece BPE model trained here (byte fallback, a user-defined piece) written to
  GGUF's tokenizer.ggml.* keys: our ids are SentencePiece's own, decoding inverts them."""
  spm = pytest.importorskip('sentencepiece')
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text('\n'.join([
      'the draft proposes tokens and the target verifies them in parallel',
      'speculative sampling keeps the target distribution exactly',
      'a smaller model guesses; the larger one checks every guess at once',
      'rejection sampling corrects the first rejected token'] * 20))
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / 'sp'), vocab_size=420, model_type='bpe',
      byte_fallback=True, user_defined_symbols=['<start_of_turn>'],
      add_dummy_prefix=add_space_prefix, character_coverage=1.0, minloglevel=2,
      remove_extra_whitespaces=False, normalization_rule_name='identity')  # as Llama 2, Gemma
  sp = spm.SentencePieceProcessor(model_file=str(tmp_path / 'sp.model'))
  pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else
           4 if pieces[i] == '<start_of_turn>' else 1 for i in range(len(pieces))]

  def configure(writer):
    writer.add_tokenizer_model('llama')
    writer.add_token_list(pieces)
    writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_add_space_prefix(add_space_prefix)

  _write(tmp_path / 't.gguf', {'token_embd.weight': np.zeros((len(pieces), 8), np.float32)},
         configure=configure)
  tok = gguf_reader.load_tokenizer(tmp_path / 't.gguf')
  for text in ['the target verifies them', 'Speculative  sampling, exactly!',
               'ünïcode → 123 and émoji 🙂', ' leading space', '<start_of_turn>the draft']:
    ids = tok.encode(text, add_bos=False)
    assert ids == sp.encode(text), text
    assert tok.decode(ids) == sp.decode(ids), text


@pytest.mark.parametrize('model,pre,message', [('bert', 'default', "'bert' tokenizer"),
                                               ('gpt2', 'mystery', "pre-tokenizer 'mystery'")])
def test_tokenizer_errors(tmp_path, model, pre, message):
  _tokenizer_file(tmp_path / 't.gguf', model=model, pre=pre)
  with pytest.raises(ValueError, match=message):
    gguf_reader.load_tokenizer(tmp_path / 't.gguf')
