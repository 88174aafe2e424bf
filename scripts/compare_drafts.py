r"""α, c and speedup of every draft kind for SmolLM2-135M-Instruct, side by side.

In one process, on the built-in demo prompts at batch 1 (one prompt per round, every case once
per round, interleaved: `speclm.analysis.benchmarking`), the baseline (`autoregressive_decode`)
and `speculative_decode` with a fixed γ for each draft, at temperature 0 and 1:

  * trained 2-layer: the shipped standalone draft (`speclm.presets.smollm2_draft`);
  * prompt lookup (`speclm.models.lookup`, 1–3-token matches);
  * lookup first: prompt lookup where the last 2+ tokens occurred before, the trained draft
    elsewhere (the demo's draft);
  * with `--eagle_path`: that EAGLE-style draft (`scripts/train_smollm2_eagle.py`), alone and
    behind lookup first (`lookup.LookupFirstWithFeatures`);
  * with `--ngram_path`: an n-gram draft saved by `speclm.models.ngram.save`.

α is pooled over the rounds (the exact β sums); the speedup is the median over rounds of the
baseline's time / the case's time (`benchmarking.ratio`); c is one draft step over one target
step at batch 1 (`speclm.run.calibration.measure_costs`, a context of 64). Every generation
makes exactly `--max_new_tokens` tokens (the end token is not a stop), and greedy outputs are
checked equal to the baseline's. The models run on the packed CPU kernels, as the demo does. It
prints the table and writes it to --output (docs/draft_comparison.md; never edit that by hand):

  python scripts/compare_drafts.py --eagle_path=/tmp/out/eagle.safetensors
  python scripts/compare_drafts.py --rounds=1 --max_new_tokens=8 --output=/tmp/d.md  # smoke
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app
from absl import flags

import speclm
from speclm.analysis import benchmarking
from speclm.analysis.benchmarking import Case
from speclm.data import builtin_prompts
from speclm.models import lookup
from speclm.models import ngram
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.run import calibration

_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Interleaved rounds (a demo prompt each).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'Draft tokens per round (every draft).')
_EAGLE = flags.DEFINE_string('eagle_path', None, 'An EAGLE-style draft file to compare.')
_NGRAM = flags.DEFINE_string('ngram_path', None, 'An n-gram draft file to compare.')
_BUILTIN = flags.DEFINE_bool('builtin_drafts', True,
                             'Include the shipped drafts (trained 2-layer, prompt lookup, lookup'
                             ' first); false: only those given by path.')
_COST_REPEATS = flags.DEFINE_integer('cost_repeats', 5, 'Repeats when timing c.')
_LOOKUP_MIN_NGRAM = flags.DEFINE_integer('lookup_min_ngram', 2,
                                         'Shortest match that lets prompt lookup propose first.')
_OUTPUT = flags.DEFINE_string(
    'output', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                           'draft_comparison.md'), 'Where the report goes.')

TEMPERATURES = (0.0, 1.0)


def drafts(target) -> dict[str, speclm.Model]:
  """The drafts compared, by name, in the table's order."""
  out = {}
  if _BUILTIN.value:
    trained = smollm2_draft.load(target, cpu_kernels=True)
    out = {'trained 2-layer': trained,
           'prompt lookup': lookup.prompt_lookup(target.vocab_size),
           'lookup first (trained 2-layer)': lookup.lookup_first(
               trained, min_ngram=_LOOKUP_MIN_NGRAM.value)}
  if _EAGLE.value:
    feature_draft = smollm2_draft.load_eagle(target, _EAGLE.value, cpu_kernels=True)
    out['EAGLE-style'] = feature_draft
    out['lookup first (EAGLE-style)'] = lookup.lookup_first(
        feature_draft, min_ngram=_LOOKUP_MIN_NGRAM.value)
  if _NGRAM.value:
    out[f'n-gram ({os.path.basename(_NGRAM.value)})'] = ngram.load(_NGRAM.value)
  return out


def make_case(name, target, draft, temperature, prompts) -> Case:
  """A batch-1 case decoding demo prompt `round % 8` (the baseline when `draft` is None)."""
  sampling = speclm.SamplingConfig(temperature=temperature) if temperature else speclm.GREEDY
  holder = []

  def run(round_index):
    tokens, lengths = prompts[round_index % len(prompts)]
    kwargs = dict(sampling=sampling, max_new_tokens=_MAX_NEW.value, eos_id=None,
                  seed=round_index)
    if draft is None:
      result = speclm.autoregressive_decode(target, tokens, lengths, **kwargs)
    else:
      result = speclm.speculative_decode(target, draft, tokens, lengths, gamma=_GAMMA.value,
                                         **kwargs)
      holder[0].stats.append(result.stats)
    return np.asarray(result.tokens)

  holder.append(Case(name, 'main', 1, temperature, _MAX_NEW.value, run))
  return holder[0]


def report(cases, costs, seconds) -> str:
  lines = benchmarking.report_header('Drafts for SmolLM2-135M compared', 'scripts/compare_drafts.py',
                                     seconds)
  lines += [
      f'- the {len(builtin_prompts.demo_prompts())} demo prompts, one per round, batch 1,'
      f' {_ROUNDS.value} rounds, {_MAX_NEW.value} new tokens each, γ = {_GAMMA.value}, float32'
      ' with the packed CPU kernels; speedup = median over rounds of the baseline\'s time over'
      ' the case\'s; c = one draft step / one target step (batch 1, context 64)', '',
      '| draft | α, T = 0 | tokens / call, T = 0 | speedup, T = 0 | α, T = 1 |'
      ' tokens / call, T = 1 | speedup, T = 1 | c | greedy output = baseline |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  base = {t: benchmarking.find(cases, 'baseline', 1, t) for t in TEMPERATURES}
  for name, cost in costs.items():
    row = [name]
    for t in TEMPERATURES:
      case = benchmarking.find(cases, name, 1, t)
      row += [f'{case.pooled_alpha():.3f}', f'{case.tokens_per_target_call():.2f}',
              f'{benchmarking.ratio(case, base[t]):.2f}×']
    greedy = benchmarking.outputs_equal(benchmarking.find(cases, name, 1, 0.0), base[0.0])
    row += [f'{cost:.3f}', 'yes' if greedy else 'NO']
    lines.append('| ' + ' | '.join(row) + ' |')
  lines += ['', f'Baseline: {benchmarking.median(base[0.0].ms_per_token()):.1f} ms per token at'
            f' T = 0, {benchmarking.median(base[1.0].ms_per_token()):.1f} at T = 1 (medians).',
            '']
  return '\n'.join(lines)


def main(argv):
  del argv
  start = time.time()
  target, tok = smollm2.load(cpu_kernels=True)
  compared = drafts(target)
  if not compared:
    raise app.UsageError('No drafts to compare: keep --builtin_drafts or give --eagle_path or'
                         ' --ngram_path.')
  prompts = [benchmarking.chat_prompt_batch(tok, [p]) for p in builtin_prompts.demo_prompts()]
  costs = {}
  for name, draft in compared.items():
    costs[name] = calibration.measure_costs(target, draft, gamma=_GAMMA.value,
                                            repeats=_COST_REPEATS.value).c
    print(f'c of {name}: {costs[name]:.3f}', flush=True)
  cases = [make_case('baseline', target, None, t, prompts) for t in TEMPERATURES]
  cases += [make_case(name, target, draft, t, prompts)
            for name, draft in compared.items() for t in TEMPERATURES]
  print('compiling and warming up:', flush=True)
  benchmarking.warm_up(cases)
  benchmarking.run_rounds(cases, _ROUNDS.value)
  benchmarking.write_report(report(cases, costs, time.time() - start), _OUTPUT.value)


if __name__ == '__main__':
  app.run(main)
