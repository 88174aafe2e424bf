"""scripts/benchmark_t5.py: its floor's byte count by hand, its size configs, and an end-to-end
run on the shared tiny T5X checkpoint (the real run takes ~16 minutes; docs/benchmarks_t5.md)."""

import os

import jax
import pytest

from speclm import protocol
from speclm.models import t5
from speclm.testing import scripts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'scripts', 'benchmark_t5.py')
TINY_CHECKPOINT = os.path.join(REPO, '..', 'shared', 'fixtures', 't5x',
                               'test_t5_tiny.checkpoint_0')


@pytest.fixture(scope='module')
def script():
  return scripts.load_script(SCRIPT)


def test_size_configs_are_float32_t5_1_1(script):
  small = script.size_config('small')
  assert small.version == '1.1' and (small.dtype, small.param_dtype) == ('float32', 'float32')
  assert t5.count_params(small) == 76_961_152  # google/t5-v1_1-small
  assert t5.count_params(script.size_config('large')) == 783_150_080


def test_decoder_step_bytes_of_t5_1_1_small_by_hand(script):
  definition = t5.T5(script.size_config('small'))
  shapes = jax.eval_shape(definition.init_params, jax.random.key(0))
  model = protocol.Model(definition, shapes)
  # Per decoder layer: self- and cross-attention 2 × 4 × 512 × 384, the gated MLP
  # 3 × 512 × 1024, three norms of 512; then the final norm, the relative position table
  # (32 buckets × 6 heads), the output layer 512 × 32128, and one embedding row.
  layer = 2 * 4 * 512 * 384 + 3 * 512 * 1024 + 3 * 512
  weights = 8 * layer + 512 + 32 * 6 + 512 * 32128 + 512
  per_position = 2 * 8 * 6 * 64 * 4  # keys and values of every decoder layer, float32
  assert script.bytes_per_decoder_step(model, 1, 10, 64) == 4 * weights + per_position * 74
  assert (script.bytes_per_decoder_step(model, 3, 10, 64) ==
          4 * (weights + 2 * 512) + 3 * per_position * 74)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TINY_CHECKPOINT), reason='shared T5X fixtures not present')
def test_smoke_run_on_the_shared_t5x_checkpoint(tmp_path):
  pytest.importorskip('transformers')
  report = tmp_path / 'benchmarks_t5.md'
  scripts.run_script(SCRIPT, '--target=tiny', '--draft=tiny',
                     f'--target_checkpoint={TINY_CHECKPOINT}', '--rounds=1',
                     '--max_new_tokens=6', '--input_length=10', '--batch_size=2',
                     f'--output={report}')
  text = report.read_text()
  assert '- target: T5 1.1 tiny, 1M parameters, float32, restored from a checkpoint' in text
  assert '- draft: T5 1.1 tiny, 1M parameters, float32, random weights' in text
  for heading in ('## Time per generated token', '## Ratios', '## Against the theory',
                  "## The paper's Table 2 pairs", '## Memory-bandwidth floor',
                  '## Exactness checks'):
    assert heading in text
  for case in ('speclm baseline', 'speclm speculative', 'HF generate()',
               'HF assisted generation'):
    assert f'| {case} |' in text
  checks = text.split('## Exactness checks')[1]
  assert '- greedy speculative = baseline, batch 1: yes' in checks
  assert '- greedy speculative = baseline, batch 2: yes' in checks
  assert '- HF assisted = HF generate() (greedy): yes' in checks
  assert 'NO' not in checks


def test_scripts_defining_the_same_flags_load_side_by_side(script):
  # Both benchmarks define --max_new_tokens; each loaded script gets flags of its own.
  from absl import flags  # pylint: disable=g-import-not-at-top
  other = scripts.load_script(os.path.join(REPO, 'scripts', 'benchmark.py'))
  assert script.flags.FLAGS is not flags.FLAGS
  assert script.flags.FLAGS.max_new_tokens == 64 and other.flags.FLAGS.max_new_tokens == 128
  assert 'max_new_tokens' not in flags.FLAGS
