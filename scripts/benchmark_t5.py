r"""Side-by-side decoding benchmark for a T5 target/draft pair (the paper's model family).

The T5 counterpart of `scripts/benchmark.py`, with the same harness
(`speclm.analysis.benchmarking`): in one process, interleaved round by round,

  * speclm's baseline and speculative decoding at batch 1 (temperature 0 and 1) and at
    `--batch_size` (temperature 0);
  * Hugging Face transformers `T5ForConditionalGeneration.generate()` and assisted generation
    (`generate(assistant_model=…)`, γ fixed to ours), PyTorch on CPU, on the same float32
    weights (`speclm.checkpoints.hf_t5.to_transformers`);
  * the ablation of the CPU kernel: our decoders with XLA's products instead of
    `speclm.kernels.cpu_matmul` (`t5.pack_for_cpu`, on by default; `--cpu_kernels=false`);
  * the memory-bandwidth floor of one decoder step (decoder weights, the token's embedding row,
    self-attention and cross-attention keys and values), probed every round;
  * c and r, and Theorem 3.8 evaluated twice: from the α measured here, and from the paper's
    Table 2 α and γ for this draft size with the c and r measured here — what a fine-tuned pair
    of these sizes would gain on this machine.

Weights. `--target_checkpoint` / `--draft_checkpoint` take any T5 checkpoint speclm reads (T5X
Orbax or legacy msgpack, or a Hugging Face directory); without them the models have random
weights at the sizes of `--target` and `--draft` (T5 1.1, `configs/models/t5_1_1/*.gin`).
Random weights time exactly like trained ones, so per-token times, the floor, c, r and the
comparison with Hugging Face hold; α does not (two random models rarely agree), so the
speculative-over-baseline ratio measured with them says nothing about trained T5 pairs. No
T5 checkpoint can be downloaded on a machine without network; the Table 2 rows are the
prediction that stands in for it.

Inputs are random token ids of `--input_length` (a new draw each round; batch rows differ).
Every row generates exactly `--max_new_tokens` tokens (the end token is not a stop).

  python scripts/benchmark_t5.py                 # T5 1.1 large target, small draft (~16 min)
  python scripts/benchmark_t5.py --target=base --rounds=1 --max_new_tokens=8 \
      --output=/tmp/t5.md                        # a smoke run
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from absl import app
from absl import flags

import speclm
from speclm import protocol
from speclm import trees
from speclm.analysis import benchmarking
from speclm.analysis import theory
from speclm.analysis.benchmarking import Case
from speclm.analysis.benchmarking import find
from speclm.analysis.benchmarking import fmt
from speclm.run import providers
from speclm.analysis.benchmarking import median
from speclm.analysis.benchmarking import ratio
from speclm.models import t5
from speclm.run import calibration

SIZES = ('tiny', 'small', 'base', 'large', 'xl', 'xxl')
_TARGET = flags.DEFINE_enum('target', 'large', SIZES, 'T5 1.1 size of the target.')
_DRAFT = flags.DEFINE_enum('draft', 'small', SIZES, 'T5 1.1 size of the draft.')
_TARGET_CHECKPOINT = flags.DEFINE_string(
    'target_checkpoint', None, 'T5X or Hugging Face checkpoint of the target (its config must'
    ' match --target); random weights without it.')
_DRAFT_CHECKPOINT = flags.DEFINE_string('draft_checkpoint', None,
                                        'Checkpoint of the draft, as --target_checkpoint.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Interleaved repetitions of every case.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens generated per row.')
_INPUT_LENGTH = flags.DEFINE_integer('input_length', 64, 'Encoder input tokens per row.')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'Draft tokens per round at batch 1 (ours and HF).')
_BATCH = flags.DEFINE_integer('batch_size', 8, 'The larger batch size measured.')
_BATCH_GAMMA = flags.DEFINE_integer('batch_gamma', 1, 'γ at --batch_size.')
_THREADS = flags.DEFINE_integer('threads', 2, 'PyTorch CPU threads for Hugging Face.')
_HF = flags.DEFINE_bool('hf', True, 'Include Hugging Face transformers cases.')
_CPU_KERNELS = flags.DEFINE_bool('cpu_kernels', True,
                                 'Run our products through speclm.kernels.cpu_matmul'
                                 ' (t5.pack_for_cpu) and time XLA\'s products as the ablation.')
_OUTPUT = flags.DEFINE_string(
    'output', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                           'benchmarks_t5.md'), 'Markdown report to write.')

GREEDY = speclm.GREEDY
SAMPLED = speclm.SamplingConfig(temperature=1.0)
XLA_BASE = 'baseline, XLA products (before)'
XLA_SPEC = 'speculative, XLA products (before)'
_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'configs', 'models', 't5_1_1')


def size_config(size: str) -> t5.T5Config:
  """The float32 `T5Config` of a T5 1.1 size, read from `configs/models/t5_1_1/{size}.gin`."""
  config = providers.t5_config_from_gin(os.path.join(_CONFIG_DIR, f'{size}.gin'),
                                        f't5_1_1_{size}')
  return dataclasses.replace(config, dtype='float32', param_dtype='float32')


def load(size: str, checkpoint: str | None, seed: int) -> protocol.Model:
  """A float32 T5 of this size: restored from `checkpoint`, or random (seeded) without one."""
  definition = t5.T5(size_config(size))
  if checkpoint is None:
    return protocol.Model(definition, jax.jit(definition.init_params)(jax.random.key(seed)))
  from speclm import checkpoints  # pylint: disable=import-outside-toplevel
  return protocol.Model(definition, jax.device_put(
      checkpoints.load_t5_params(checkpoint, definition)))


def inputs_of_round(round_index: int, batch_size: int, vocab_size: int) -> np.ndarray:
  """`[B, P]` random encoder ids (no padding, no end token), one draw per round."""
  rng = np.random.default_rng(1000 * batch_size + round_index)
  return rng.integers(2, min(vocab_size, 32000), (batch_size, _INPUT_LENGTH.value), np.int32)


def gamma_at(batch_size: int) -> int:
  return _BATCH_GAMMA.value if batch_size > 1 else _GAMMA.value


def speclm_cases(target, draft, xla_models=None) -> list[Case]:
  """Our cases; with `xla_models` (the unpacked pair), the ablation of the CPU kernel too."""
  def make(name, group, batch_size, sampling, target_model, draft_model=None):
    holder = []

    def run(round_index):
      tokens = inputs_of_round(round_index, batch_size, target.vocab_size)
      lengths = np.full((batch_size,), tokens.shape[1], np.int32)
      kwargs = dict(sampling=sampling, max_new_tokens=_MAX_NEW.value, eos_id=None,
                    seed=round_index)
      if draft_model is None:
        result = speclm.autoregressive_decode(target_model, tokens, lengths, **kwargs)
      else:
        result = speclm.speculative_decode(target_model, draft_model, tokens, lengths,
                                           gamma=gamma_at(batch_size), **kwargs)
      holder[0].stats.append(result.stats)
      return np.asarray(result.tokens)

    holder.append(Case(name, group, batch_size, sampling.temperature, _MAX_NEW.value, run))
    return holder[0]

  base, spec = 'speclm baseline', 'speclm speculative'
  cases = [make(base, 'main', 1, GREEDY, target), make(spec, 'main', 1, GREEDY, target, draft),
           make(base, 'main', 1, SAMPLED, target), make(spec, 'main', 1, SAMPLED, target, draft),
           make(base, 'main', _BATCH.value, GREEDY, target),
           make(spec, 'main', _BATCH.value, GREEDY, target, draft)]
  if xla_models is not None:
    xla_target, xla_draft = xla_models
    cases += [make(XLA_BASE, 'ablation', 1, GREEDY, xla_target),
              make(XLA_SPEC, 'ablation', 1, GREEDY, xla_target, xla_draft)]
  return cases


def hf_cases(target, draft) -> list[Case]:
  import torch  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import hf_t5  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(_THREADS.value)
  hf_target, hf_draft = hf_t5.to_transformers(target), hf_t5.to_transformers(draft)

  def make(name, temperature, assisted):
    generation_config = benchmarking.hf_generation_config(
        temperature=temperature, assisted=assisted, new_tokens=_MAX_NEW.value,
        gamma=_GAMMA.value, pad_id=target.definition.config.pad_id)

    def run(round_index):
      ids = torch.from_numpy(inputs_of_round(round_index, 1, target.vocab_size).astype(np.int64))
      torch.manual_seed(round_index)
      with torch.no_grad():
        out = hf_target.generate(ids, attention_mask=torch.ones_like(ids),
                                 generation_config=generation_config,
                                 assistant_model=hf_draft if assisted else None)
      return out[:, 1:].numpy()  # after the decoder start token

    return Case(name, 'hf', 1, temperature, _MAX_NEW.value, run)

  return [make('HF generate()', 0.0, False), make('HF assisted generation', 0.0, True),
          make('HF generate()', 1.0, False), make('HF assisted generation', 1.0, True)]


def bytes_per_decoder_step(model: protocol.Model, batch_size: int, decoded: int,
                           encoded: int) -> int:
  """What one decoder step must read: the decoder's weights (and the output layer), one
  embedding row per row (the whole embedding when it is also the output layer), and the self-
  and cross-attention keys and values of `decoded` and `encoded` positions. The encoder
  runs once per generation and is not counted."""
  config = model.definition.config
  total = 0
  for name, leaf in trees.flatten(model.params).items():
    itemsize = np.dtype(leaf.dtype).itemsize
    if name.startswith('decoder/'):
      total += int(np.prod(leaf.shape)) * itemsize
    elif name == 'token_embedder/embedding':
      rows = config.vocab_size if config.logits_via_embedding else batch_size
      total += rows * config.emb_dim * itemsize
  per_position = (2 * config.num_decoder_layers * config.num_heads * config.head_dim *
                  np.dtype(config.dtype).itemsize)
  return total + batch_size * per_position * (decoded + encoded)


def main(argv):
  del argv
  started = time.time()
  if _MAX_NEW.value < 2:
    raise app.UsageError('--max_new_tokens must be at least 2.')
  print(f'building T5 1.1 {_TARGET.value} (target) and {_DRAFT.value} (draft) …', flush=True)
  target = load(_TARGET.value, _TARGET_CHECKPOINT.value, seed=0)
  draft = load(_DRAFT.value, _DRAFT_CHECKPOINT.value, seed=1)
  random_weights = _TARGET_CHECKPOINT.value is None or _DRAFT_CHECKPOINT.value is None
  plain = (target, draft)  # XLA's products; what HF export and the byte count read
  if _CPU_KERNELS.value:
    target, draft = t5.pack_for_cpu(target), t5.pack_for_cpu(draft)
  cases = speclm_cases(target, draft, xla_models=plain if target is not plain[0] else None)
  if _HF.value:
    cases += hf_cases(*plain)

  print(f'compiling and warming up {len(cases)} cases …', flush=True)
  benchmarking.warm_up(cases)
  bandwidths = benchmarking.run_rounds(cases, _ROUNDS.value)

  checks = {}
  for batch_size in (1, _BATCH.value):
    checks[f'greedy speculative = baseline, batch {batch_size}'] = benchmarking.outputs_equal(
        find(cases, 'speclm baseline', batch_size, 0.0),
        find(cases, 'speclm speculative', batch_size, 0.0))
  ablations = []
  for name, after_name in ((XLA_BASE, 'speclm baseline'), (XLA_SPEC, 'speclm speculative')):
    for batch_size in (1, _BATCH.value):
      before = find(cases, name, batch_size, 0.0)
      if before is None:
        continue
      after = find(cases, after_name, batch_size, 0.0)
      checks[f'{name} = baseline, batch {batch_size}'] = benchmarking.outputs_equal(
          find(cases, 'speclm baseline', batch_size, 0.0), before)
      ablations.append(dict(change=name, batch_size=batch_size,
                            before_ms=median(before.ms_per_token()),
                            after_ms=median(after.ms_per_token()), speedup=ratio(after, before)))
  hf_agreement = None
  if _HF.value:
    ours, theirs = find(cases, 'speclm baseline', 1, 0.0), find(cases, 'HF generate()', 1, 0.0)
    hf_agreement = float(np.mean([np.mean(a == b) for a, b in zip(ours.outputs,
                                                                    theirs.outputs)]))
    checks['HF assisted = HF generate() (greedy)'] = benchmarking.outputs_equal(
        theirs, find(cases, 'HF assisted generation', 1, 0.0))

  ratios = {}
  for batch_size, temperature in ((1, 0.0), (1, 1.0), (_BATCH.value, 0.0)):
    ratios[f'speculative / baseline, T={temperature:g}, batch {batch_size}'] = ratio(
        find(cases, 'speclm speculative', batch_size, temperature),
        find(cases, 'speclm baseline', batch_size, temperature))
  if _HF.value:
    for temperature in (0.0, 1.0):
      ratios[f'baseline / HF generate(), T={temperature:g}, batch 1'] = ratio(
          find(cases, 'speclm baseline', 1, temperature),
          find(cases, 'HF generate()', 1, temperature))
      ratios[f'speculative / HF assisted, T={temperature:g}, batch 1'] = ratio(
          find(cases, 'speclm speculative', 1, temperature),
          find(cases, 'HF assisted generation', 1, temperature))

  # c and r: at the γ of each measured setting and of each Table 2 row of this draft size.
  paper_rows = {key: value for key, value in theory.PAPER_TABLE2.items()
                if key[1] == _DRAFT.value}
  print('timing c and r …', flush=True)
  costs = {}
  for batch_size, gamma in sorted({(1, _GAMMA.value), (_BATCH.value, _BATCH_GAMMA.value)} |
                                  {(1, g) for g, _, _ in paper_rows.values()}):
    costs[(batch_size, gamma)] = calibration.measure_costs(
        target, draft, gamma=gamma, batch_size=batch_size, context_length=_INPUT_LENGTH.value)

  predictions = {}
  for case in cases:
    if case.name != 'speclm speculative':
      continue
    gamma = gamma_at(case.batch_size)
    cost = costs[(case.batch_size, gamma)]
    alpha = case.pooled_alpha()
    key = f'speculative / baseline, T={case.temperature:g}, batch {case.batch_size}'
    predictions[key] = dict(
        alpha=alpha, gamma=gamma, c=cost.c, r=cost.r,
        tokens_per_call=case.tokens_per_target_call(),
        predicted=float(theory.walltime_improvement(alpha, gamma, cost.c, cost.r)),
        measured=ratios[key])
  paper = []
  for (task, size, temperature), (gamma, alpha, speedup) in sorted(paper_rows.items()):
    cost = costs[(1, gamma)]
    paper.append(dict(task=task, temperature=temperature, gamma=gamma, alpha=alpha,
                      paper_speedup=speedup, c=cost.c, r=cost.r,
                      predicted=float(theory.walltime_improvement(alpha, gamma, cost.c,
                                                                  cost.r))))
  base_ms = find(cases, 'speclm baseline', 1, 0.0).ms_per_token()
  decoded = _MAX_NEW.value // 2
  step_bytes = bytes_per_decoder_step(plain[0], 1, decoded, _INPUT_LENGTH.value)
  floor_ms = [1e3 * step_bytes / bandwidth for bandwidth in bandwidths]
  summary = dict(cases=cases, ratios=ratios, predictions=predictions, paper=paper, checks=checks,
                 ablations=ablations,
                 hf_agreement=hf_agreement, bandwidths=bandwidths, floor_ms=floor_ms,
                 base_ms=base_ms, step_bytes=step_bytes, decoded=decoded,
                 random_weights=random_weights, target=target, draft=draft,
                 seconds=time.time() - started)
  benchmarking.write_report(render(summary), _OUTPUT.value)


def _model_line(role: str, size: str, model: protocol.Model, checkpoint: str | None) -> str:
  source = 'random weights' if checkpoint is None else 'restored from a checkpoint'
  return (f'- {role}: T5 1.1 {size}, {model.definition.num_params() / 1e6:.0f}M parameters,'
          f' float32, {source}')


def render(s: dict) -> str:
  lines = benchmarking.report_header('Benchmarks: T5', 'scripts/benchmark_t5.py',
                                      s['seconds']) + [
      _model_line('target', _TARGET.value, s['target'], _TARGET_CHECKPOINT.value),
      _model_line('draft', _DRAFT.value, s['draft'], _DRAFT_CHECKPOINT.value),
      f'- settings: γ = {_GAMMA.value} at batch 1 and {_BATCH_GAMMA.value} at batch'
      f' {_BATCH.value}; products through '
      + ('speclm\'s CPU kernel (`t5.pack_for_cpu`)' if _CPU_KERNELS.value else 'XLA') +
      f'; {_INPUT_LENGTH.value} random encoder tokens per row (a new draw each'
      f' round); {_MAX_NEW.value} new tokens per row (end token ignored); {_ROUNDS.value}'
      f' interleaved rounds; Hugging Face runs PyTorch on {_THREADS.value} threads, float32,'
      ' same weights, assisted generation with γ constant assistant tokens',
  ]
  if s['random_weights']:
    lines += [
        '',
        '**Random weights.** Times, c, r and the floor are those of trained models of these'
        ' sizes; α is not: two random models rarely agree, so the measured speculative /'
        ' baseline ratios below reflect that α and nothing about trained T5 pairs. The'
        ' Table 2 section predicts what the paper\'s fine-tuned pairs would gain here.',
    ]
  lines += [''] + benchmarking.time_table(s['cases'])
  floor_ratio = benchmarking.floor_ratio(s['base_ms'], s['floor_ms'])
  lines += ['', '## Ratios (median of per-round ratios)', '', '| ratio | measured |',
            '| --- | --- |']
  lines += [f'| {name} | {fmt(value)}× |' for name, value in s['ratios'].items()]
  lines += [
      f'| baseline time / memory-bandwidth floor, batch 1 | {floor_ratio:.2f}× |',
      '',
      '## Against the theory, as measured (Theorem 3.8 with r: (1 − α^(γ+1)) / ((1 − α)(γc +'
      ' r)))',
      '',
      '| setting | γ | α | tokens / target call | c | r | predicted | measured |'
      ' measured / predicted |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- |',
  ]
  for name, p in s['predictions'].items():
    rel = None if p['measured'] is None else p['measured'] / p['predicted']
    lines.append(f'| {name} | {p["gamma"]} | {p["alpha"]:.3f} | {p["tokens_per_call"]:.2f} |'
                 f' {p["c"]:.3f} | {p["r"]:.2f} | {p["predicted"]:.2f}× |'
                 f' {fmt(p["measured"])}× | {fmt(rel)} |')
  lines += [
      '',
      f'## The paper\'s Table 2 pairs on this machine (T5 1.1 {_DRAFT.value} draft)',
      '',
      'The paper measured these α with fine-tuned T5-XXL targets on a TPU-v4. Here the'
      f' same α and γ are combined with the c and r of this run\'s {_TARGET.value} target'
      ' and draft at batch 1 (`speclm.run.calibration.measure_costs`, context'
      f' {_INPUT_LENGTH.value}): the walltime improvement Theorem 3.8 predicts for such a'
      ' pair here.',
      '',
      '| task | T | γ | α (paper) | paper\'s speedup (XXL, TPU) | c here | r here |'
      ' predicted here |',
      '| --- | --- | --- | --- | --- | --- | --- | --- |',
  ]
  if not s['paper']:
    lines.append(f'| (Table 2 has no rows for a {_DRAFT.value} draft) | | | | | | | |')
  for p in s['paper']:
    lines.append(f'| {p["task"]} | {p["temperature"]:g} | {p["gamma"]} | {p["alpha"]:.2f} |'
                 f' {p["paper_speedup"]:.1f}× | {p["c"]:.3f} | {p["r"]:.2f} |'
                 f' {p["predicted"]:.2f}× |')
  lines += ['']
  lines += benchmarking.floor_section(
      s['bandwidths'], s['floor_ms'], s['base_ms'],
      'bytes one batch-1 decoder step reads (decoder weights and output layer, one embedding'
      f' row, keys and values of {s["decoded"]} decoded and {_INPUT_LENGTH.value} encoded'
      f' positions): {s["step_bytes"] / 1e6:.0f} MB')
  lines += ['', '## Exactness checks', ''] + benchmarking.check_lines(s['checks'])
  if s['hf_agreement'] is not None:
    lines.append(f'- our greedy baseline vs HF greedy `generate()`: {100 * s["hf_agreement"]:.1f}%'
                 ' of tokens equal')
  if s['ablations']:
    lines += ['', '## What the CPU kernel moved (interleaved in the same run, T = 0)', '',
              '| before | batch | ms / token before | after | speedup |',
              '| --- | --- | --- | --- | --- |']
    lines += [f'| {a["change"]} | {a["batch_size"]} | {a["before_ms"]:.1f} |'
              f' {a["after_ms"]:.1f} | {fmt(a["speedup"])}× |' for a in s['ablations']]
  lines.append('')
  return '\n'.join(lines)


if __name__ == '__main__':
  app.run(main)
