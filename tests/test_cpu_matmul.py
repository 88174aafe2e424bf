"""speclm.kernels.cpu_matmul, llama.pack_for_cpu and t5.pack_for_cpu: accurate,
row-independent, used."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import speclm
from speclm.kernels import cpu_matmul
from speclm.models import llama
from speclm.models import t5

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not cpu_matmul.available(),
                                reason='the CPU kernel could not be built here')


@pytest.mark.parametrize('rows,inputs,outputs', [(1, 576, 1536), (4, 576, 192), (5, 64, 8193),
                                                 (8, 1536, 576), (13, 33, 70), (20, 7, 64)])
def test_matmul_matches_a_float64_product(rows, inputs, outputs):
  rng = np.random.default_rng(rows)
  x = rng.standard_normal((rows, inputs)).astype(np.float32)
  w = rng.standard_normal((inputs, outputs)).astype(np.float32)
  y = np.asarray(jax.jit(cpu_matmul.matmul, static_argnums=2)(x, cpu_matmul.pack(w), outputs))
  exact = x.astype(np.float64) @ w.astype(np.float64)
  xla_error = np.abs(np.asarray(jax.numpy.dot(x, w)) - exact).max()
  assert y.shape == (rows, outputs)
  # Blocked summation into a float64 total: no less accurate than XLA's own product.
  assert np.abs(y - exact).max() <= xla_error + 1e-7 * np.abs(exact).max()


def test_long_sums_of_large_terms_round_less_than_xlas():
  """A few huge inputs (as SmolLM2's massive activations): the float64 total pays off.

  Five seeds measured the kernel's max error at 0.14-0.32 of XLA's float32 running sum.
  """
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 1536)).astype(np.float32)
  x[:, :8] *= 300
  w = rng.standard_normal((1536, 576)).astype(np.float32)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  y = np.asarray(jax.jit(cpu_matmul.matmul, static_argnums=2)(x, cpu_matmul.pack(w), 576))
  xla_error = np.abs(np.asarray(jax.numpy.dot(x, w)) - exact).max()
  assert np.abs(y - exact).max() < 0.5 * xla_error


def test_a_rows_result_does_not_depend_on_the_other_rows():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((11, 96)).astype(np.float32)
  packed = cpu_matmul.pack(rng.standard_normal((96, 130)).astype(np.float32))
  matmul = jax.jit(cpu_matmul.matmul, static_argnums=2)
  whole = np.asarray(matmul(x, packed, 130))
  for r in (0, 7, 10):
    np.testing.assert_array_equal(np.asarray(matmul(x[r:r + 1], packed, 130))[0], whole[r])
    np.testing.assert_array_equal(np.asarray(matmul(x[r:r + 3], packed, 130))[0], whole[r])


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_all_zero_rows_give_zeros_and_leave_the_other_rows_sums_alone(dtype):
  """The kernel multiplies only rows with a nonzero entry (zero_rows.h): what `extend_live`'s
  positions that are not needed cost nothing by. Signed zeros count as zero, NaN does not."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((7, 96)).astype(np.float32)
  x[[1, 2, 5]] = 0.0
  x[2, ::3] = -0.0
  x[6, 4] = np.nan
  packed = cpu_matmul.pack(rng.standard_normal((96, 130)).astype(np.float32), dtype)
  matmul = jax.jit(cpu_matmul.matmul, static_argnums=2)
  y = np.asarray(matmul(x, packed, 130))
  assert np.all(y[[1, 2, 5]] == 0.0) and not np.signbit(y[[1, 2, 5]]).any()
  for r in (0, 3, 4):
    np.testing.assert_array_equal(y[r], np.asarray(matmul(x[r:r + 1], packed, 130))[0])
  assert np.isnan(y[6]).all()
  assert not np.asarray(matmul(np.zeros((3, 96), np.float32), packed, 130)).any()


@pytest.mark.parametrize('rows', [1, 3, 8, 13])
def test_bfloat16_panels_give_the_float32_kernels_sums_bit_for_bit(rows):
  """Weights that are bfloat16 values: half the bytes, the very same result."""
  rng = np.random.default_rng(rows)
  x = rng.standard_normal((rows, 200)).astype(np.float32)
  w = rng.standard_normal((200, 150)).astype(jax.numpy.bfloat16).astype(np.float32)
  matmul = jax.jit(cpu_matmul.matmul, static_argnums=2)
  packed = cpu_matmul.pack(w, 'bfloat16')
  assert packed.dtype == jax.numpy.bfloat16 and packed.nbytes == cpu_matmul.pack(w).nbytes // 2
  np.testing.assert_array_equal(np.asarray(matmul(x, packed, 150)),
                                np.asarray(matmul(x, cpu_matmul.pack(w), 150)))
  exact = x.astype(np.float64) @ w.astype(np.float64)
  assert np.abs(np.asarray(matmul(x, packed, 150)) - exact).max() < 1e-4


def test_auto_packs_bfloat16_only_where_it_is_lossless():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((40, 70)).astype(np.float32)
  assert not cpu_matmul.bfloat16_exact(w)
  assert cpu_matmul.pack(w, 'auto').dtype == np.float32
  rounded = w.astype(jax.numpy.bfloat16).astype(np.float32)
  assert cpu_matmul.bfloat16_exact(rounded)
  assert cpu_matmul.pack(rounded, 'auto').dtype == jax.numpy.bfloat16
  # Rounding on request: the panels hold the rounded weights.
  np.testing.assert_array_equal(
      np.asarray(cpu_matmul.pack(w, 'bfloat16'), np.float32)[0, :, :], rounded[:, :64])
  with pytest.raises(ValueError, match='dtype'):
    cpu_matmul.pack(w, 'float16')


def test_pack_layout_and_errors():
  w = np.arange(6 * 70, dtype=np.float32).reshape(6, 70)
  packed = cpu_matmul.pack(w)
  assert packed.shape == (2, 6, 64)
  np.testing.assert_array_equal(packed[1, :, :6], w[:, 64:])
  assert not packed[1, :, 6:].any()  # zero padding
  with pytest.raises(ValueError, match='2-D'):
    cpu_matmul.pack(np.zeros((2, 3, 4), np.float32))
  with pytest.raises(TypeError, match='float32'):
    cpu_matmul.matmul(jax.numpy.zeros((2, 6), jax.numpy.bfloat16), packed, 70)
  with pytest.raises(TypeError, match='float32'):
    cpu_matmul.matmul(jax.numpy.zeros((2, 6)), packed.astype(np.float16), 70)


def _models():
  target = llama.random_model(vocab_size=200, embed_dim=64, num_layers=2, seed=0, mlp_dim=128)
  draft = llama.random_model(vocab_size=200, embed_dim=64, num_layers=1, seed=1, mlp_dim=128)
  return target, draft


def test_packed_model_uses_the_kernel_for_few_rows_and_xla_for_prompts():
  target, _ = _models()
  packed = llama.pack_for_cpu(target)
  assert packed.params['layers_0']['attention']['out']['packed'].shape == (1, 64, 64)
  assert packed.params['lm_head']['packed'].shape == (4, 64, 64)  # head untied, 200 -> 256

  def uses_kernel(length):
    tokens = np.zeros((1, length), np.int32)
    jaxpr = jax.make_jaxpr(packed.definition.forward)(packed.params, tokens)
    return cpu_matmul.TARGET_NAME in str(jaxpr)

  # Decode steps and verification calls (up to MAX_KERNEL_ROWS rows) stream the panels;
  # longer prompts take XLA's product of the plain kernel, which is faster there.
  assert cpu_matmul.MAX_KERNEL_ROWS == 16
  assert all(uses_kernel(length) for length in (1, 2, 16))
  assert not any(uses_kernel(length) for length in (17, 64))
  prompt = np.arange(40, dtype=np.int32)[None] % 200
  # Two programs (the head untied, the products placed apart): equal within a few float32
  # rounding steps of logits up to about 3.
  np.testing.assert_allclose(packed.definition.forward(packed.params, prompt),
                             target.definition.forward(target.params, prompt), rtol=1e-6,
                             atol=1e-6)
  tokens = np.zeros((1, 3), np.int32)
  assert cpu_matmul.TARGET_NAME not in str(
      jax.make_jaxpr(target.definition.forward)(target.params, tokens))  # plain: XLA's dots


def test_a_model_stored_in_bfloat16_is_packed_in_bfloat16_with_the_same_logits():
  _, draft = _models()
  rounded = jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16).astype(np.float32),
                         dict(draft.params))
  draft = speclm.protocol.Model(draft.definition, rounded)
  packed = llama.pack_for_cpu(draft)
  assert packed.params['layers_0']['mlp']['gate']['packed'].dtype == jax.numpy.bfloat16
  tokens = np.array([[5, 6, 7, 8, 9]], np.int32)
  np.testing.assert_allclose(packed.definition.forward(packed.params, tokens),
                             draft.definition.forward(draft.params, tokens), atol=1e-5)


def test_packed_model_gives_the_same_logits_and_exact_speculative_decoding():
  target, draft = _models()
  packed_target, packed_draft = llama.pack_for_cpu(target), llama.pack_for_cpu(draft)
  tokens = np.array([[5, 6, 7, 8, 9], [9, 10, 11, 12, 13]], np.int32)
  np.testing.assert_allclose(packed_target.definition.forward(packed_target.params, tokens),
                             target.definition.forward(target.params, tokens), atol=1e-5)
  prompts = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  base = speclm.autoregressive_decode(packed_target, prompts, lengths, max_new_tokens=24)
  spec = speclm.speculative_decode(packed_target, packed_draft, prompts, lengths, gamma=4,
                                   max_new_tokens=24)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  plain = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=24)
  np.testing.assert_array_equal(base.tokens, plain.tokens)


def _t5_models():
  target = t5.random_model(vocab_size=200, emb_dim=64, num_layers=2, num_heads=4, seed=0)
  draft = t5.random_model(vocab_size=200, emb_dim=64, num_layers=1, num_heads=4, seed=1)
  return target, draft


def test_packed_t5_uses_the_kernel_with_the_same_logits_and_exact_speculative_decoding():
  target, draft = _t5_models()
  packed_target, packed_draft = t5.pack_for_cpu(target), t5.pack_for_cpu(draft)
  decoder = packed_target.params['decoder']
  assert decoder['layers_0']['self_attention']['out']['packed'].shape == (1, 64, 64)  # [64, 64]
  assert decoder['logits_dense']['packed'].shape == (4, 64, 64)  # 200 -> 256 columns
  inputs = np.array([[5, 6, 7, 8, 1], [9, 10, 1, 0, 0]], np.int32)
  lengths = np.array([5, 3], np.int32)
  decoder_tokens = np.array([[0, 4, 5, 6], [0, 7, 8, 9]], np.int32)
  forward = packed_target.definition.forward
  assert cpu_matmul.TARGET_NAME in str(jax.make_jaxpr(forward)(
      packed_target.params, inputs, lengths, decoder_tokens))
  np.testing.assert_allclose(forward(packed_target.params, inputs, lengths, decoder_tokens),
                             forward(target.params, inputs, lengths, decoder_tokens), atol=1e-5)
  base = speclm.autoregressive_decode(packed_target, inputs, lengths, max_new_tokens=24,
                                      eos_id=None)
  spec = speclm.speculative_decode(packed_target, packed_draft, inputs, lengths, gamma=4,
                                   max_new_tokens=24, eos_id=None)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  plain = speclm.autoregressive_decode(target, inputs, lengths, max_new_tokens=24, eos_id=None)
  np.testing.assert_array_equal(base.tokens, plain.tokens)


def test_t5_pack_for_cpu_leaves_other_dtypes_alone():
  model = t5.random_model(vocab_size=64, emb_dim=16, dtype='bfloat16')
  assert t5.pack_for_cpu(model) is model


# ----------------------------------------------------------------------------------------------
# The kernel cache: nothing is loaded from it unchecked, and no failure is fatal. Each case runs
# `available()` in a fresh process (a truncated library would kill this one with SIGBUS) with
# SPECLM_KERNEL_CACHE in a temporary directory. CXX is a stand-in compiler that logs its call
# and copies the kernel this process already built, so a rebuild costs no compile.

_PROBE = textwrap.dedent("""
    import json, logging
    import numpy as np
    warnings = []
    class Collect(logging.Handler):
      def emit(self, record):
        if record.levelno >= logging.WARNING:
          warnings.append(record.getMessage())
    logging.getLogger('absl').addHandler(Collect())
    from speclm.kernels import cpu_matmul
    ok = cpu_matmul.available()
    correct = None
    if ok:
      x = np.arange(6, dtype=np.float32).reshape(2, 3)
      w = np.arange(15, dtype=np.float32).reshape(3, 5)
      correct = bool(np.allclose(np.asarray(cpu_matmul.matmul(x, cpu_matmul.pack(w), 5)), x @ w))
    print(json.dumps({'available': ok, 'correct': correct, 'warnings': warnings}))
""")


@pytest.fixture(scope='module')
def good_kernel():
  """The kernel this process built (path, SHA-256)."""
  path = cpu_matmul.build()
  with open(path + '.sha256', encoding='ascii') as f:
    recorded = f.read().split()[0]
  return path, recorded


def _sha256(path):
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


class Cache:
  """A kernel cache directory in `tmp_path`, seeded with a copy of the good build."""

  def __init__(self, tmp_path, good_kernel, seed=True):
    self.tmp = tmp_path
    self.dir = tmp_path / 'kernels'
    self.dir.mkdir(mode=0o700)
    good, self.good_hash = good_kernel
    self.so = self.dir / os.path.basename(good)
    self.sha = self.dir / (self.so.name + '.sha256')
    if seed:
      shutil.copy(good, self.so)
      shutil.copy(good + '.sha256', self.sha)
    self.compile_log = tmp_path / 'compiles.log'
    self.cxx = tmp_path / 'fake_cxx.sh'
    self.cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        out=
        while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
        echo compiled >> '{self.compile_log}'
        cp '{good}' "$out"
        """))
    self.cxx.chmod(0o755)

  def run(self, **env):
    environ = dict(os.environ, SPECLM_KERNEL_CACHE=str(self.dir), CXX=str(self.cxx),
                   JAX_PLATFORMS='cpu', PYTHONPATH=REPO + os.pathsep + os.environ.get(
                       'PYTHONPATH', ''))
    environ.update(env)
    proc = subprocess.run([sys.executable, '-c', _PROBE], env=environ, cwd=self.tmp,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])

  @property
  def compiles(self):
    return len(self.compile_log.read_text().splitlines()) if self.compile_log.exists() else 0

  def assert_valid_build(self):
    """The cache holds the good kernel, recorded, ours and writable by us alone."""
    assert _sha256(self.so) == self.good_hash
    assert self.sha.read_text().split()[0] == self.good_hash
    for path in (self.so, self.sha):
      st = os.lstat(path)
      assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _compile_c(tmp_path, source, name):
  cc = shutil.which('cc') or shutil.which('gcc')
  if cc is None:
    pytest.skip('no C compiler for the foreign library')
  c_file = tmp_path / f'{name}.c'
  c_file.write_text(source)
  out = tmp_path / f'{name}.so'
  subprocess.run([cc, '-shared', '-fPIC', str(c_file), '-o', str(out)], check=True)
  return out


def test_a_valid_cached_kernel_is_loaded_without_rebuilding(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel)
  result = cache.run()
  assert result == {'available': True, 'correct': True, 'warnings': []}
  assert cache.compiles == 0
  cache.assert_valid_build()


def test_a_truncated_cached_kernel_is_rebuilt_not_loaded(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel)
  data = cache.so.read_bytes()
  cache.so.write_bytes(data[:len(data) // 2])  # the old code died of SIGBUS (exit 135) here
  result = cache.run()
  assert result['available'] and result['correct']
  assert cache.compiles == 1
  assert len(result['warnings']) == 1 and 'differs from the recorded one' in result['warnings'][0]
  cache.assert_valid_build()
  assert cache.run() == {'available': True, 'correct': True, 'warnings': []}  # and it stays
  assert cache.compiles == 1


def test_a_foreign_library_at_the_cache_path_is_never_loaded(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel)
  marker = tmp_path / 'constructor_ran'
  foreign = _compile_c(tmp_path, textwrap.dedent(f"""\
      #include <stdio.h>
      __attribute__((constructor)) static void run_on_load(void) {{
        FILE *f = fopen("{marker}", "w");
        if (f) fclose(f);
      }}
      """), 'foreign')
  shutil.copy(foreign, cache.so)  # the recorded hash is the real kernel's
  result = cache.run()
  assert not marker.exists()
  assert result['available'] and result['correct'] and cache.compiles == 1
  cache.assert_valid_build()


@pytest.mark.parametrize('tamper', ['library 0o666', 'hash file 0o666', 'library of uid 65534',
                                    'library a symlink', 'hash file missing'])
def test_a_library_that_others_could_have_written_is_rebuilt(tmp_path, good_kernel, tamper):
  cache = Cache(tmp_path, good_kernel)
  if tamper == 'library 0o666':
    cache.so.chmod(0o666)
  elif tamper == 'hash file 0o666':
    cache.sha.chmod(0o666)
  elif tamper == 'library of uid 65534':
    if os.getuid() != 0:
      pytest.skip('changing a file owner needs root')
    os.chown(cache.so, 65534, 65534)
  elif tamper == 'library a symlink':
    target = tmp_path / 'elsewhere.so'
    cache.so.rename(target)
    cache.so.symlink_to(target)
  else:
    cache.sha.unlink()
  result = cache.run()
  assert result['available'] and result['correct'] and cache.compiles == 1
  cache.assert_valid_build()


def test_a_cache_directory_writable_by_others_is_made_private_and_rebuilt(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel)
  cache.dir.chmod(0o777)
  result = cache.run()
  assert stat.S_IMODE(os.stat(cache.dir).st_mode) == 0o700
  assert result['available'] and result['correct'] and cache.compiles == 1
  assert len(result['warnings']) == 1 and 'made it 0700' in result['warnings'][0]
  cache.assert_valid_build()


def test_a_cache_directory_of_another_user_is_not_used(tmp_path, good_kernel):
  if os.getuid() != 0:
    pytest.skip('changing a directory owner needs root')
  cache = Cache(tmp_path, good_kernel)
  os.chown(cache.dir, 65534, 65534)
  before = sorted(os.listdir(cache.dir))
  result = cache.run()
  assert result['available'] and result['correct'] and cache.compiles == 1  # built elsewhere
  assert len(result['warnings']) == 1 and 'not a private directory' in result['warnings'][0]
  assert sorted(os.listdir(cache.dir)) == before


def test_a_fresh_cache_directory_is_private(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel, seed=False)
  cache.dir.rmdir()
  result = cache.run()
  assert result['available'] and cache.compiles == 1
  assert stat.S_IMODE(os.stat(cache.dir).st_mode) & 0o077 == 0
  cache.assert_valid_build()


def test_no_compiler_falls_back_to_xla_with_one_warning_line(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel, seed=False)
  result = cache.run(CXX='/bin/false')
  assert result['available'] is False
  assert len(result['warnings']) == 1
  (warning,) = result['warnings']
  assert 'using XLA products' in warning and '/bin/false' in warning and '\n' not in warning
  assert not cache.so.exists()


def test_a_build_without_the_kernels_symbols_falls_back_and_is_not_kept(tmp_path, good_kernel):
  cache = Cache(tmp_path, good_kernel, seed=False)
  empty = _compile_c(tmp_path, 'int speclm_unrelated(void) { return 0; }\n', 'empty')
  cache.cxx.write_text(cache.cxx.read_text().replace(good_kernel[0], str(empty)))
  result = cache.run()  # the old code raised AttributeError here
  assert result['available'] is False
  assert len(result['warnings']) == 1 and 'AttributeError' in result['warnings'][0]
  assert not cache.so.exists() and not cache.sha.exists()  # the next run compiles again
