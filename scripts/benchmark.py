r"""Side-by-side decoding benchmark on the embedded default (SmolLM2-135M-Instruct + its draft).

In one process, interleaved round by round (every case runs once per round, so slow drift of
a noisy machine hits all cases alike), on the built-in demo prompts:

  * speclm's baseline (`autoregressive_decode`) and speculative decoding (`speculative_decode`)
    at batch 1 and batch 8, temperature 0 and 1, with a fixed γ and with adaptive γ
    (`speclm.adaptive`: γ chosen every round from the running α and the c and r(γ) timed for
    that batch size), side by side; and the time to the first token (prefill);
  * Hugging Face transformers `generate()` and assisted generation
    (`generate(assistant_model=…)`, γ fixed to ours) on the same float32 weights, PyTorch on
    CPU; our draft is exported as a `LlamaForCausalLM` whose logits are −inf off its subset
    (`hf_llama.subset_draft_to_transformers`);
  * ablations of this session's CPU optimisations (the "before" variants are rebuilt here);
  * the memory-bandwidth floor: bytes the target reads per call / bandwidth probed every round;
  * c and r of the models, and the generalised Theorem 3.8 prediction from measured α, c, r.

Every generation makes exactly `--max_new_tokens` tokens (the end token is not a stop here),
so tokens/s compare equal work. Batch-1 cases all decode the same prompt within a round and a
different prompt each round. Greedy outputs are checked: speculative = baseline token for
token, and our baseline against Hugging Face's.

It prints the table and ratios and writes `docs/benchmarks.md` (never edit that by hand):

  python scripts/benchmark.py                       # the full run (about 40 minutes here)
  python scripts/benchmark.py --rounds=1 --max_new_tokens=16 --output=/tmp/b.md  # a smoke run

Workloads: `--workload=demo` (default) decodes the 8 built-in demo prompts as above.
`--workload=spec_bench --spec_bench_file=question.jsonl` runs Spec-Bench (Xia et al., 2024:
MT-bench with its two turns, translation, summarization, QA, math, RAG; its
`data/spec_bench/question.jsonl` is Apache-2.0 and not shipped with speclm) on the first
`--per_category` conversations of each task, every turn, batch 1, at `--temperatures`, every
method side by side (scripts/spec_bench_methods.py): the baseline, fixed γ, adaptive γ, the
job's tree policy, the best static tree, prompt lookup alone and (--hf) Hugging Face's
assisted generation; a later turn follows the method's own reply. Our speculative methods
draft with `--spec_bench_draft` behind prompt lookup: the EAGLE-3 draft of the Spec-Bench job
(`runs/spec_bench.gin`, the default) or the token-only 2-layer draft. Hugging Face's assisted
generation always runs the 2-layer draft (it cannot read the target's features). It prints the
table per task and writes it as the report's "Spec-Bench" section, keeping the rest of the
report (a demo run keeps that section too). The questions are an evaluation set: nothing in
speclm was trained or tuned on them.

  python scripts/benchmark.py --workload=spec_bench --spec_bench_file=question.jsonl \
      --per_category=4
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shlex
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

import speclm
from speclm import sampling as sampling_lib
from speclm import protocol
from speclm import speculative
from speclm.analysis import benchmarking
from speclm.analysis import theory
from speclm.analysis.benchmarking import Case
from speclm.analysis.benchmarking import find
from speclm.analysis.benchmarking import fmt
from speclm.analysis.benchmarking import median
from speclm.analysis.benchmarking import ratio
from speclm.checkpoints import gguf
from speclm.data import builtin_prompts
from speclm.models import llama
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm import tree_decoding
from speclm.data import conversations
from speclm.run import calibration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling module
import spec_bench_methods  # pylint: disable=g-import-not-at-top,wrong-import-position

_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Interleaved repetitions of every case.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per row.')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'Draft tokens per speculative round at batch 1 (ours and'
                              ' HF); 3 is the best for the shipped draft on 2 CPU cores'
                              ' (docs/performance.md).')
_OTHER_GAMMAS = flags.DEFINE_list(
    'other_gammas', ['1', '2', '4'], 'More fixed γ at batch 1 (beside --gamma), so the adaptive'
    ' cases are compared with the best fixed γ measured in the same run.')
_BATCH = flags.DEFINE_integer('batch_size', 8, 'The larger batch size measured.')
_BATCH_GAMMA = flags.DEFINE_integer('batch_gamma', 1,
                                    'γ at --batch_size. A verification call costs more rows'
                                    ' there, so the best γ is smaller.')
_THREADS = flags.DEFINE_integer('threads', 2, 'PyTorch CPU threads for Hugging Face.')
_CPU_KERNELS = flags.DEFINE_bool('cpu_kernels', True,
                                 'Run our products through speclm.kernels.cpu_matmul'
                                 ' (llama.pack_for_cpu); the ablation times XLA\'s products.')
_LOOKUP_MIN_NGRAM = flags.DEFINE_integer(
    'lookup_min_ngram', 2, 'As the demo: prompt lookup proposes where the last n+ tokens'
    ' occurred before, the trained draft elsewhere (lookup.lookup_first); 0: the draft alone.')
_HF = flags.DEFINE_bool('hf', True, 'Include Hugging Face transformers cases.')
_ADAPTIVE = flags.DEFINE_bool('adaptive', True, 'Include the adaptive-γ cases.')
_MAX_GAMMA = flags.DEFINE_integer('max_gamma', 4, 'γ_max of the adaptive cases.')
_COST_TOKENS = flags.DEFINE_integer(
    'cost_tokens', None, 'New tokens per timed decode when c and r(γ) are timed for the adaptive'
    ' cases (`calibration.measure_round_costs`; default: `calibration.round_cost_tokens` of the'
    ' context); fewer for a smoke run.')
_COST_REPEATS = flags.DEFINE_integer(
    'cost_repeats', 3, 'Timed repeats when c and r(γ) are timed for the adaptive cases.')
_POLICY_ROWS = flags.DEFINE_integer(
    'policy_rows', 4, "Spec-Bench: first turns the tree policy calibrates on, spread over their"
    " lengths (the job's `tree_policy.calibration_rows`); each length compiles its decodes.")
_DRAFT_STOPPING = flags.DEFINE_bool('draft_stopping', False,
                                    'Adaptive cases: the draft stops on its own confidence.')
_WORKLOAD = flags.DEFINE_enum('workload', 'demo', ['demo', 'spec_bench'],
                              'Prompts: the built-in demo prompts, or Spec-Bench\'s.')
_SPEC_BENCH_FILE = flags.DEFINE_string(
    'spec_bench_file', None, 'Spec-Bench\'s question.jsonl (from the repository'
    ' hemingkx/Spec-Bench, data/spec_bench/question.jsonl; not shipped with speclm).')
_SPEC_BENCH_DRAFT = flags.DEFINE_enum(
    'spec_bench_draft', 'eagle', ['eagle', 'two_layer'],
    'Spec-Bench workload: the draft of the speculative methods, the EAGLE-3 draft that reads the'
    ' target\'s features (as runs/spec_bench.gin) or the token-only 2-layer draft.')
_PER_CATEGORY = flags.DEFINE_integer('per_category', 1,
                                     'Spec-Bench conversations taken from each task.')
_TEMPERATURES = flags.DEFINE_list('temperatures', ['0'],
                                  'Spec-Bench workload: the sampling temperatures run.')
_ABLATIONS = flags.DEFINE_bool('ablations', True, 'Include the before/after ablations.')
_TARGET_LAYERS = flags.DEFINE_integer(
    'target_layers', 0, 'Smoke runs: cut the target to its first N layers (llama.first_layers;'
    ' its programs compile in a fraction of the time, its replies are not SmolLM2\'s and its'
    ' timings mean nothing); 0: the whole model.')
_OUTPUT = flags.DEFINE_string(
    'output', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                           'benchmarks.md'), 'Markdown report to write.')

GREEDY = speclm.GREEDY
SAMPLED = speclm.SamplingConfig(temperature=1.0)

# Targets of the speed issues (ratio name -> minimum).
TARGETS = {
    'speculative / baseline, T=0, batch 1': 1.6,
    'speculative / baseline, T=1, batch 1': 1.3,
    'speculative / baseline, T=0, batch 8': 1.0,
    'speculative / baseline, T=1, batch 8': 1.0,
    'adaptive γ / baseline, T=0, batch 1': 1.6,
    'adaptive γ / baseline, T=1, batch 1': 1.3,
    'adaptive γ / baseline, T=0, batch 8': 1.0,
    'adaptive γ / baseline, T=1, batch 8': 1.0,
    'adaptive γ / fixed γ, T=0, batch 1': 0.97,
    'adaptive γ / fixed γ, T=1, batch 1': 0.97,
    'adaptive γ / fixed γ, T=0, batch 8': 0.97,
    'adaptive γ / fixed γ, T=1, batch 8': 0.97,
    'speculative / HF assisted, T=0, batch 1': 2.0,
    'baseline / HF generate(), T=0, batch 1': 1.5,
}


# ----------------------------------------------------------------------------------------------
# "Before" variants for the ablations.


@dataclasses.dataclass(frozen=True)
class _BeforeSampling(sampling_lib.SamplingConfig):
  """Equal fields, another class: its own entry in the decode loops' compilation cache."""


@dataclasses.dataclass(frozen=True)
class _BeforeGreedyRound(sampling_lib.SamplingConfig):
  """As `_BeforeSampling`, for the one-hot greedy round's ablation."""


def _float32_panels(model):
  """`model` with its bfloat16 kernel panels widened to float32: the same values (so the same
  outputs), twice the bytes to read; the draft as it ran before bfloat16 panels."""
  def widen(tree):
    out = {}
    for key, value in tree.items():
      if key == 'packed':
        out[key] = value.astype(jnp.float32)
      else:
        out[key] = widen(value) if isinstance(value, dict) else value
    return out
  return speclm.protocol.Model(model.definition, widen(dict(model.params)))


def _gumbel_sample(rng, probs):
  """The sampler before this change: Gumbel-max over the whole vocabulary."""
  log_probs = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return jax.random.categorical(rng, log_probs, axis=-1).astype(jnp.int32)


def _argmax_one_hot(logits):
  """The greedy rule before this change: `jnp.argmax` (a variadic reduction on CPU)."""
  return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)


def _one_hot_greedy_ids(logits):
  """Greedy tokens before `sampling.greedy_ids`: the one-hot row, then a draw from it."""
  return sampling_lib.sample(jax.random.key(0), sampling_lib._first_argmax_one_hot(logits))  # pylint: disable=protected-access


def _one_hot_greedy_round(vocab: int):
  """The greedy round before `speculative.greedy_round`: Algorithm 1 on one-hot p̃ and q̃
  over the whole vocabulary (the same decisions)."""
  def round_(draft_tokens, target_tokens):
    return speculative.speculative_round(
        jax.nn.one_hot(draft_tokens, vocab), draft_tokens,
        jax.nn.one_hot(target_tokens, vocab), jnp.zeros(draft_tokens.shape),
        jax.random.key(0))
  return round_


@contextlib.contextmanager
def _patched(module, **replacements):
  """While active, `module`'s attributes are replaced (decode loops traced for the first time
  then use the replacements)."""
  saved = {name: getattr(module, name) for name in replacements}
  for name, value in replacements.items():
    setattr(module, name, value)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(module, name, value)


@contextlib.contextmanager
def _before_greedy_round(vocab: int):
  """The temperature-0 path before `greedy_round`: one-hot rows and Algorithm 1 on them."""
  with _patched(sampling_lib, greedy_ids=_one_hot_greedy_ids), \
       _patched(speculative, greedy_round=_one_hot_greedy_round(vocab)):
    yield


@contextlib.contextmanager
def _before_sampling(vocab: int):
  """The sampling code before the sampler and argmax changes (and the one-hot greedy path,
  which they were measured with)."""
  with _before_greedy_round(vocab), _patched(
      sampling_lib, sample=_gumbel_sample, _first_argmax_one_hot=_argmax_one_hot):
    yield


# ----------------------------------------------------------------------------------------------
# Cases


def workload_prompts() -> list[tuple[str, str]]:
  """(category, prompt) pairs of the demo workload (Spec-Bench's runs `run_spec_bench`)."""
  return [('demo', p) for p in builtin_prompts.demo_prompts()]


def speclm_cases(target, draft, tok, prompts, *, rules=None, tied_target=None, xla_models=None,
                 draft_alone=None, float32_draft=None) -> list[Case]:
  """`rules`: batch size -> the `adaptive.AdaptiveGamma` of the adaptive cases (None: none)."""
  width = benchmarking.padded_width(max(len(tok.encode_chat(p)) for p in prompts))
  single = [benchmarking.chat_prompt_batch(tok, [p]) for p in prompts]
  batches = [benchmarking.chat_prompt_batch(
                 tok, [prompts[(k + i) % len(prompts)] for i in range(_BATCH.value)],
                           width) for k in range(0, len(prompts), _BATCH.value)]

  def make(name, group, batch_size, sampling, model, draft_model=None, before=None,
           gamma=None, new_tokens=None):
    """`before`: None, or 'sampling' / 'greedy round' (an ablation's "before" code)."""
    case_holder = []
    new_tokens = new_tokens or _MAX_NEW.value

    def run(round_index):
      tokens, lengths = (batches[round_index % len(batches)] if batch_size > 1
                         else single[round_index % len(single)])
      kwargs = dict(sampling=sampling, max_new_tokens=new_tokens, eos_id=None,
                    seed=round_index)
      if draft_model is None:
        result = speclm.autoregressive_decode(model, tokens, lengths, **kwargs)
      else:
        result = speclm.speculative_decode(model, draft_model, tokens, lengths,
                                           gamma=gamma or _gamma(batch_size), **kwargs)
      out = np.asarray(result.tokens)
      case_holder[0].stats.append(result.stats)
      return out

    context = None
    if before:
      config_class, context = {'sampling': (_BeforeSampling, _before_sampling),
                               'greedy round': (_BeforeGreedyRound, _before_greedy_round)}[before]
      sampling = config_class(**dataclasses.asdict(sampling))
      context = functools.partial(context, model.definition.vocab_size)
    case = Case(name, group, batch_size, sampling.temperature, new_tokens, run,
                trace_context=context)
    case_holder.append(case)
    return case

  cases = [
      make('speclm baseline', 'main', 1, GREEDY, target),
      make('speclm speculative', 'main', 1, GREEDY, target, draft),
      make('speclm baseline', 'main', 1, SAMPLED, target),
      make('speclm speculative', 'main', 1, SAMPLED, target, draft),
      make('speclm baseline', 'main', _BATCH.value, GREEDY, target),
      make('speclm speculative', 'main', _BATCH.value, GREEDY, target, draft),
      make('speclm baseline', 'main', _BATCH.value, SAMPLED, target),
      make('speclm speculative', 'main', _BATCH.value, SAMPLED, target, draft),
  ]
  cases += [make(f'speclm speculative γ={gamma}', 'main', 1, sampling, target, draft,
                 gamma=gamma)
            for gamma in _other_gammas() for sampling in (GREEDY, SAMPLED)]
  if rules:
    cases += [make('speclm adaptive γ', 'main', batch_size, sampling, target, draft,
                   gamma=rules[batch_size])
              for batch_size in (1, _BATCH.value) for sampling in (GREEDY, SAMPLED)]
  # Time to the first token: the prefill (and the draft's, for speculative decoding).
  cases += [make('time to first token, baseline', 'ttft', 1, GREEDY, target, new_tokens=1),
            make('time to first token, speculative', 'ttft', 1, GREEDY, target, draft,
                 new_tokens=1)]
  if _ABLATIONS.value:
    cases += [
        make('baseline, argmax + Gumbel sampler (before)', 'ablation', 1, GREEDY, target,
             before='sampling'),
        make('speculative, argmax + Gumbel sampler (before)', 'ablation', 1, GREEDY, target,
             draft, before='sampling'),
        make('speculative, Gumbel sampler (before)', 'ablation', 1, SAMPLED, target, draft,
             before='sampling'),
    ]
    cases += [make('speculative, one-hot greedy round (before)', 'ablation', batch_size,
                   GREEDY, target, draft, before='greedy round')
              for batch_size in (1, _BATCH.value)]
    if draft_alone is not None:
      cases += [make('speculative, trained draft alone (before)', 'ablation', batch_size,
                     sampling, target, draft_alone)
                for batch_size, sampling in ((1, GREEDY), (1, SAMPLED), (_BATCH.value, GREEDY))]
    if float32_draft is not None:
      cases += [make('speculative, float32 draft panels (before)', 'ablation', batch_size,
                     GREEDY, target, float32_draft) for batch_size in (1, _BATCH.value)]
    if tied_target is not None:
      cases.append(make('baseline, XLA products, tied [V, D] head (before)', 'ablation', 1,
                        GREEDY, tied_target))
    if xla_models is not None:
      xla_target, xla_draft = xla_models
      cases += [
          make('baseline, XLA products (before)', 'ablation', 1, GREEDY, xla_target),
          make('speculative, XLA products (before)', 'ablation', 1, GREEDY, xla_target,
               xla_draft),
          make('baseline, XLA products (before)', 'ablation', _BATCH.value, GREEDY, xla_target),
          make('speculative, XLA products (before)', 'ablation', _BATCH.value, GREEDY,
               xla_target, xla_draft),
      ]
  return cases


def hf_cases(target, draft, tok, prompts) -> list[Case]:
  import torch  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(_THREADS.value)
  hf_target = hf_llama.to_transformers(target)
  hf_draft = hf_llama.subset_draft_to_transformers(draft)
  inputs = [torch.tensor([tok.encode_chat(p)], dtype=torch.long) for p in prompts]

  def make(name, temperature, assisted):
    generation_config = benchmarking.hf_generation_config(
        temperature=temperature, assisted=assisted, new_tokens=_MAX_NEW.value,
        gamma=_GAMMA.value, pad_id=tok.pad_id or 0)

    def run(round_index):
      ids = inputs[round_index % len(inputs)]
      torch.manual_seed(round_index)
      with torch.no_grad():
        out = hf_target.generate(ids, attention_mask=torch.ones_like(ids),
                                 generation_config=generation_config,
                                 assistant_model=hf_draft if assisted else None)
      return out[:, ids.shape[1]:].numpy()

    return Case(name, 'hf', 1, temperature, _MAX_NEW.value, run)

  return [make('HF generate()', 0.0, False), make('HF assisted generation', 0.0, True),
          make('HF generate()', 1.0, False), make('HF assisted generation', 1.0, True)]


# ----------------------------------------------------------------------------------------------
# Spec-Bench: every method side by side (scripts/spec_bench_methods.py runs and reports them)

def _policy_choice(target, draft, vocabulary, turns, temperature: float):
  """The job's `@tree_policy()` (its default candidates) calibrated as a batch-1 job does: on
  --policy_rows first turns spread over their lengths (`tree_policy.spread_prompts`), at most
  32 new tokens, --cost_repeats timed repeats."""
  policy = calibration.TreePolicy(
      calibration.default_candidates(), calibration_rows=_POLICY_ROWS.value,
      repeats=_COST_REPEATS.value,
      calibration_tokens=min(calibration.TreePolicy.calibration_tokens, _MAX_NEW.value))
  firsts = [vocabulary.encode_conversation([{'role': 'user', 'content': turn.input}])
            for turn in turns if turn.turn == 1]
  batches = calibration.tree_policy.spread_prompts(firsts, policy.calibration_rows)
  choice = calibration.choose(policy, target, draft, batches, gamma=_GAMMA.value,
                              sampling=speclm.SamplingConfig(temperature=temperature), seed=0)
  print(f'tree policy at T={temperature:g}: {choice.summary()}', flush=True)
  return choice


_SPEC_BENCH_DRAFT_NAMES = {
    'eagle': 'the shipped EAGLE-3 draft (as runs/spec_bench.gin)',
    'two_layer': 'the shipped token-only 2-layer draft'}


def spec_bench_method_list(models: dict, vocabulary, turns, temperature: float, rule):
  """The methods side by side: the baseline, fixed γ, adaptive γ (`rule`; None: left out),
  the tree policy's choice, the best static tree, prompt lookup alone, HF assisted (--hf).

  Args:
    models: 'target', 'draft' (the speculative methods' draft behind prompt lookup,
      --spec_bench_draft), 'plain_target', 'plain_draft' (XLA's products, for Hugging Face's
      export).
  """
  target, draft = models['target'], models['draft']
  method = functools.partial(spec_bench_methods.speclm_method, max_new_tokens=_MAX_NEW.value)
  chain = functools.partial(speclm.speculative_decode, target, draft, gamma=_GAMMA.value)
  methods = [method(spec_bench_methods.BASELINE,
                            functools.partial(speclm.autoregressive_decode, target)),
             method(f'fixed γ={_GAMMA.value}', chain)]
  if rule is not None:
    methods.append(method('adaptive γ', functools.partial(
        speclm.speculative_decode, target, draft, gamma=rule)))
  choice = _policy_choice(target, draft, vocabulary, turns, temperature)
  methods.append(method(f'tree policy: {choice.name}', chain if choice.tree is None else
                                functools.partial(tree_decoding.tree_speculative_decode,
                                                  target, draft, tree=choice.tree)))
  name, tree = spec_bench_methods.BEST_STATIC_TREE
  methods.append(method(f'static tree {name}', functools.partial(
      tree_decoding.tree_speculative_decode, target, draft, tree=tree)))
  alone = lookup.prompt_lookup(target.definition.vocab_size)
  methods.append(method('prompt lookup alone', functools.partial(
      speclm.speculative_decode, target, alone, gamma=_GAMMA.value)))
  if _HF.value:
    methods.append(spec_bench_methods.hf_assisted_method(
        models['plain_target'], models['plain_draft'], pad_id=vocabulary.pad_id,
        max_new_tokens=_MAX_NEW.value, gamma=_GAMMA.value, threads=_THREADS.value))
  return methods


def _spec_bench_turns() -> list[conversations.Turn]:
  """The workload's turns, or a usage error naming the file to get."""
  if not _SPEC_BENCH_FILE.value:
    raise app.UsageError(
        '--workload=spec_bench needs --spec_bench_file=…/question.jsonl: the file'
        ' data/spec_bench/question.jsonl of the public repository hemingkx/Spec-Bench'
        ' (Apache-2.0), which speclm does not ship.')
  try:
    return spec_bench_methods.read_turns(_SPEC_BENCH_FILE.value, _PER_CATEGORY.value)
  except conversations.DataError as e:
    raise app.UsageError(f'{e} (--spec_bench_file: Spec-Bench\'s question.jsonl, from the'
                         ' public repository hemingkx/Spec-Bench)') from None


def run_spec_bench(models: dict, tok, turns: list[conversations.Turn], started: float) -> None:
  """--workload=spec_bench: every method on every turn, per temperature; prints the tables
  and writes the report's Spec-Bench section (the rest of the report is kept)."""
  vocabulary = spec_bench_methods.chat_vocabulary(tok)
  first = [t for t in turns if t.turn == 1]
  context = int(np.mean([len(vocabulary.encode(t.input)) for t in first])) + _MAX_NEW.value // 2
  rule = None
  if _ADAPTIVE.value:
    print('timing c and r(γ) for adaptive γ (cached per machine) …', flush=True)
    rule = calibration.measure_adaptive_gamma(
        models['target'], models['draft'], max_gamma=_MAX_GAMMA.value, batch_size=1,
        context_length=context, draft_stopping=_DRAFT_STOPPING.value,
        num_new_tokens=_COST_TOKENS.value, repeats=_COST_REPEATS.value)
  settings = (f'settings: batch 1, {_MAX_NEW.value} new tokens per turn (end token ignored),'
              f' γ = {_GAMMA.value}, adaptive γ_max {_MAX_GAMMA.value}, the first'
              f' {_PER_CATEGORY.value} conversation(s) of each task ({len(turns)} turns; a later'
              ' turn after the method\'s own reply); draft: '
              + _SPEC_BENCH_DRAFT_NAMES[_SPEC_BENCH_DRAFT.value] + (
                  f' behind prompt lookup (min n-gram {_LOOKUP_MIN_NGRAM.value})'
                  if _LOOKUP_MIN_NGRAM.value else ' alone') + _cut())
  command = shlex.join(['python', 'scripts/benchmark.py', *sys.argv[1:]])
  results = {}
  for temperature in [float(t) for t in _TEMPERATURES.value]:
    methods = spec_bench_method_list(models, vocabulary, turns, temperature, rule)
    records = spec_bench_methods.run_turns(methods, turns, vocabulary, temperature)
    results[temperature] = dict(
        tables=spec_bench_methods.category_tables(records, turns),
        checks=(spec_bench_methods.exactness_checks(methods, records) if temperature == 0
                else {}))
    # Written after each temperature, so that a later failure loses nothing measured.
    text = spec_bench_methods.section(results, command=command, settings=settings,
                                      seconds=time.time() - started)
    print(text, flush=True)
    spec_bench_methods.write_section(text, _OUTPUT.value)
    # Each method compiled its loop per input width; the next temperature compiles its own.
    # Two temperatures' programs together ran a 2-core, 24 GB machine out of memory.
    jax.clear_caches()
  if not all(all(r['checks'].values()) for r in results.values()):
    raise SystemExit('A greedy output differs from the baseline\'s: see the checks.')


def check_export(draft, hf_draft, tok, prompt) -> float:
  """Largest |logit| difference between our draft and its HF export on a prompt (subset)."""
  import torch  # pylint: disable=import-outside-toplevel
  ids = np.array([tok.encode_chat(prompt)], np.int32)
  cache = draft.definition.init_cache(1, ids.shape[1])
  ours = np.asarray(draft.definition.extend(draft.params, jnp.asarray(ids), cache)[0])
  with torch.no_grad():
    theirs = hf_draft(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  finite = np.isfinite(ours)
  if not np.array_equal(finite, np.isfinite(theirs)):
    raise AssertionError('The exported draft masks other tokens than ours.')
  return float(np.max(np.abs(ours[finite] - theirs[finite])))


# ----------------------------------------------------------------------------------------------
# Floor, costs, report


def _other_gammas() -> list[int]:
  return [int(g) for g in _OTHER_GAMMAS.value if int(g) != _GAMMA.value]


def _gamma(batch_size: int) -> int:
  """γ used at this batch size: --gamma at batch 1, --batch_gamma at --batch_size."""
  if batch_size > 1:
    return _BATCH_GAMMA.value
  return _GAMMA.value


def bytes_per_target_call(target, batch_size: int, context: int) -> int:
  """Weights one decode step must read (every matrix, one embedding row per token) plus the
  keys and values of `context` positions for every row."""
  c = target.definition.config
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
    name = jax.tree_util.keystr(path)
    if 'embedder' in name and not (c.tie_embeddings):
      total += batch_size * c.embed_dim * leaf.dtype.itemsize  # a lookup, not a read of V×D
    else:
      total += leaf.size * leaf.dtype.itemsize
  kv = 2 * c.num_layers * batch_size * context * c.num_kv_heads * c.head_dim * 4
  return total + kv


def row_alphas(stats) -> np.ndarray:
  """`[B]` each row's α (its exact β average) in one speculative run."""
  counts = np.asarray(stats.beta_count_per_row, np.float64)
  return np.asarray(stats.beta_sum_per_row, np.float64) / np.maximum(counts, 1.0)


def main(argv):
  del argv
  started = time.time()
  turns = _spec_bench_turns() if _WORKLOAD.value == 'spec_bench' else None  # before loading
  print('loading SmolLM2-135M-Instruct and its draft …', flush=True)
  # The plain models (XLA's products) are what Hugging Face export and the byte count read.
  plain_target, tok = smollm2.load()
  if _TARGET_LAYERS.value:
    plain_target = llama.first_layers(plain_target, _TARGET_LAYERS.value)
    print(f'smoke run: the target cut to its first {_TARGET_LAYERS.value} layers', flush=True)
  target = llama.pack_for_cpu(plain_target) if _CPU_KERNELS.value else plain_target
  plain_draft = smollm2_draft.load(plain_target)
  draft_alone = smollm2_draft.load(target, cpu_kernels=_CPU_KERNELS.value)
  draft, xla_draft = draft_alone, plain_draft
  if _LOOKUP_MIN_NGRAM.value:
    wrap = functools.partial(lookup.lookup_first, min_ngram=_LOOKUP_MIN_NGRAM.value)
    draft, xla_draft = wrap(draft_alone), wrap(plain_draft)
  if _WORKLOAD.value == 'spec_bench':
    if _SPEC_BENCH_DRAFT.value == 'eagle':
      draft = smollm2_draft.load_eagle(target, cpu_kernels=_CPU_KERNELS.value)
      try:  # a target cut by --target_layers may lack the layers the draft reads
        protocol.target_for_feature_draft(target, draft)
      except ValueError as e:
        raise app.UsageError(f'{e} (--spec_bench_draft=eagle reads them: raise --target_layers'
                             ' or use --spec_bench_draft=two_layer)') from None
      if _LOOKUP_MIN_NGRAM.value:
        draft = wrap(draft)
    run_spec_bench(dict(target=target, draft=draft, plain_target=plain_target,
                        plain_draft=plain_draft), tok, turns, started)
    return
  float32_draft = None
  if _CPU_KERNELS.value and _ABLATIONS.value:
    float32_draft = _float32_panels(draft_alone)
    if _LOOKUP_MIN_NGRAM.value:
      float32_draft = wrap(float32_draft)
  tied_target = None
  if _ABLATIONS.value:
    tied_target = gguf.load_model(smollm2.gguf_file())
    if _TARGET_LAYERS.value:  # a smoke run: the same cut as the target's
      tied_target = llama.first_layers(tied_target, _TARGET_LAYERS.value)
  categorized = workload_prompts()
  categories = [category for category, _ in categorized]
  prompts = [prompt for _, prompt in categorized]
  context = int(np.mean([len(tok.encode_chat(p)) for p in prompts])) + _MAX_NEW.value // 2
  rules = None
  if _ADAPTIVE.value:
    print('timing c and r(γ) for the adaptive cases (cached per machine) …', flush=True)
    rules = {b: calibration.measure_adaptive_gamma(target, draft, max_gamma=_MAX_GAMMA.value,
                                                   batch_size=b, context_length=context,
                                                   draft_stopping=_DRAFT_STOPPING.value,
                                                   num_new_tokens=_COST_TOKENS.value,
                                               repeats=_COST_REPEATS.value)
             for b in (1, _BATCH.value)}

  xla_models = (plain_target, xla_draft) if _CPU_KERNELS.value and _ABLATIONS.value else None
  cases = speclm_cases(target, draft, tok, prompts, rules=rules, tied_target=tied_target,
                       xla_models=xla_models,
                       draft_alone=draft_alone if _LOOKUP_MIN_NGRAM.value else None,
                       float32_draft=float32_draft)
  export_error = None
  if _HF.value:
    cases += hf_cases(plain_target, plain_draft, tok, prompts)
    from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
    export_error = check_export(plain_draft, hf_llama.subset_draft_to_transformers(plain_draft),
                                tok, prompts[0])
    print(f'HF draft export: max |logit difference| {export_error:.2e}', flush=True)

  print(f'compiling and warming up {len(cases)} cases …', flush=True)
  benchmarking.warm_up(cases)
  bandwidths = benchmarking.run_rounds(cases, _ROUNDS.value)

  # Exactness: greedy speculative = greedy baseline, every round (and ours vs HF).
  checks = {}
  for batch_size in (1, _BATCH.value):
    base = find(cases, 'speclm baseline', batch_size, 0.0)
    for name, label in (('speclm speculative', 'speculative'),
                        ('speclm adaptive γ', 'adaptive γ'),
                        *[(f'speclm speculative γ={g}', f'speculative γ={g}')
                          for g in _other_gammas()]):
      spec = find(cases, name, batch_size, 0.0)
      if spec is not None:
        checks[f'greedy {label} = baseline, batch {batch_size}'] = (
            benchmarking.outputs_equal(base, spec))
  for case in cases:
    if case.group == 'ablation' and case.temperature == 0:
      base = find(cases, 'speclm baseline', case.batch_size, 0.0)
      checks[f'{case.name} = baseline, batch {case.batch_size}'] = (
          benchmarking.outputs_equal(base, case))
  hf_agreement = None
  if _HF.value:
    ours, theirs = find(cases, 'speclm baseline', 1, 0.0), find(cases, 'HF generate()', 1, 0.0)
    agree = [np.mean(a[0] == b[0]) for a, b in zip(ours.outputs, theirs.outputs)]
    prefix = [int(np.argmin(np.append(a[0] == b[0], False))) for a, b in
              zip(ours.outputs, theirs.outputs)]
    hf_agreement = dict(token_agreement=float(np.mean(agree)), identical_prefix=prefix)
    assisted = find(cases, 'HF assisted generation', 1, 0.0)
    checks['HF assisted = HF generate() (greedy)'] = benchmarking.outputs_equal(theirs, assisted)

  # α from our speculative runs; c and r timed on the compiled extend calls.
  alphas = {}
  for case in cases:
    if case.name == 'speclm speculative':
      alphas[(case.batch_size, case.temperature)] = dict(
          alpha=case.pooled_alpha(), tokens_per_call=case.tokens_per_target_call(),
          row_alphas=[row_alphas(s) for s in case.stats])
  costs = {b: calibration.measure_costs(target, draft, gamma=_gamma(b), batch_size=b,
                                        context_length=context)
           for b in (1, _BATCH.value)}
  target_bytes = bytes_per_target_call(plain_target, 1, context)
  floor_ms = [1e3 * target_bytes / bandwidth for bandwidth in bandwidths]  # per round

  ratios = {
      'speculative / baseline, T=0, batch 1': ratio(
          find(cases, 'speclm speculative', 1, 0.0), find(cases, 'speclm baseline', 1, 0.0)),
      'speculative / baseline, T=1, batch 1': ratio(
          find(cases, 'speclm speculative', 1, 1.0), find(cases, 'speclm baseline', 1, 1.0)),
      f'speculative / baseline, T=0, batch {_BATCH.value}': ratio(
          find(cases, 'speclm speculative', _BATCH.value, 0.0),
          find(cases, 'speclm baseline', _BATCH.value, 0.0)),
      f'speculative / baseline, T=1, batch {_BATCH.value}': ratio(
          find(cases, 'speclm speculative', _BATCH.value, 1.0),
          find(cases, 'speclm baseline', _BATCH.value, 1.0)),
  }
  for batch_size in (1, _BATCH.value):
    for temperature in (0.0, 1.0):
      adaptive_case = find(cases, 'speclm adaptive γ', batch_size, temperature)
      if adaptive_case is not None:
        setting = f'T={temperature:g}, batch {batch_size}'
        ratios[f'adaptive γ / baseline, {setting}'] = ratio(
            adaptive_case, find(cases, 'speclm baseline', batch_size, temperature))
        ratios[f'adaptive γ / fixed γ, {setting}'] = ratio(
            adaptive_case, find(cases, 'speclm speculative', batch_size, temperature))
    if batch_size == 1:
      for temperature in (0.0, 1.0):
        base = find(cases, 'speclm baseline', 1, temperature)
        fixed = {_GAMMA.value: find(cases, 'speclm speculative', 1, temperature)}
        fixed.update({g: find(cases, f'speclm speculative γ={g}', 1, temperature)
                      for g in _other_gammas()})
        for g in _other_gammas():
          ratios[f'fixed γ={g} / baseline, T={temperature:g}, batch 1'] = ratio(fixed[g], base)
        best = max(fixed, key=lambda g: ratio(fixed[g], base))
        adaptive_case = find(cases, 'speclm adaptive γ', 1, temperature)
        if adaptive_case is not None and len(fixed) > 1:
          ratios[f'adaptive γ / best fixed γ (γ={best}), T={temperature:g}, batch 1'] = ratio(
              adaptive_case, fixed[best])
  if _HF.value:
    ratios.update({
        'speculative / HF assisted, T=0, batch 1': ratio(
            find(cases, 'speclm speculative', 1, 0.0), find(cases, 'HF assisted generation', 1,
                                                            0.0)),
        'speculative / HF assisted, T=1, batch 1': ratio(
            find(cases, 'speclm speculative', 1, 1.0), find(cases, 'HF assisted generation', 1,
                                                            1.0)),
        'baseline / HF generate(), T=0, batch 1': ratio(
            find(cases, 'speclm baseline', 1, 0.0), find(cases, 'HF generate()', 1, 0.0)),
        'HF assisted / HF generate(), T=0, batch 1': ratio(
            find(cases, 'HF assisted generation', 1, 0.0), find(cases, 'HF generate()', 1, 0.0)),
    })
  predictions = {}
  for (batch_size, temperature), a in alphas.items():
    cost = costs[batch_size]
    gamma = _gamma(batch_size)
    predicted = float(theory.walltime_improvement(a['alpha'], gamma, cost.c, cost.r))
    # Per round, from that round's α of every row: a batch runs until its slowest row is done.
    # The prefill makes the first token in both decoders; the rounds make the other N − 1.
    per_row = median([theory.batch_walltime_improvement(
        alphas_of_round, gamma, cost.c, cost.r, num_tokens=max(_MAX_NEW.value - 1, 1))
                      for alphas_of_round in a['row_alphas']])
    key = f'speculative / baseline, T={temperature:g}, batch {batch_size}'
    predictions[key] = dict(alpha=a['alpha'], c=cost.c, r=cost.r, predicted=predicted,
                            per_row=per_row, measured=ratios.get(key),
                            theorem_3_8_r1=float(theory.walltime_improvement(
                                a['alpha'], gamma, cost.c, 1.0)))
  ablations = []
  if _ABLATIONS.value:
    for name, after_name, batch_size, temperature in (
        ('baseline, argmax + Gumbel sampler (before)', 'speclm baseline', 1, 0.0),
        ('speculative, argmax + Gumbel sampler (before)', 'speclm speculative', 1, 0.0),
        ('speculative, Gumbel sampler (before)', 'speclm speculative', 1, 1.0),
        ('speculative, one-hot greedy round (before)', 'speclm speculative', 1, 0.0),
        ('speculative, one-hot greedy round (before)', 'speclm speculative', _BATCH.value,
         0.0),
        ('speculative, trained draft alone (before)', 'speclm speculative', 1, 0.0),
        ('speculative, trained draft alone (before)', 'speclm speculative', 1, 1.0),
        ('speculative, trained draft alone (before)', 'speclm speculative', _BATCH.value, 0.0),
        ('speculative, float32 draft panels (before)', 'speclm speculative', 1, 0.0),
        ('speculative, float32 draft panels (before)', 'speclm speculative', _BATCH.value, 0.0),
        ('baseline, XLA products, tied [V, D] head (before)', 'baseline, XLA products (before)',
         1, 0.0),
        ('baseline, XLA products (before)', 'speclm baseline', 1, 0.0),
        ('speculative, XLA products (before)', 'speclm speculative', 1, 0.0),
        ('baseline, XLA products (before)', 'speclm baseline', _BATCH.value, 0.0),
        ('speculative, XLA products (before)', 'speclm speculative', _BATCH.value, 0.0)):
      before = find(cases, name, batch_size, temperature)
      after = find(cases, after_name, batch_size, temperature)
      if before is not None:
        ablations.append(dict(change=name, batch_size=batch_size, temperature=temperature,
                              before_ms=median(before.ms_per_token()),
                              after_ms=median(after.ms_per_token()),
                              speedup=ratio(after, before)))

  base_ms = find(cases, 'speclm baseline', 1, 0.0).ms_per_token()  # per round
  summary = dict(cases=cases, ratios=ratios, per_category=per_category(cases, categories),
                 rules=rules, gamma_histograms=gamma_histograms(cases), predictions=predictions,
                 checks=checks,
                 hf_agreement=hf_agreement, export_error=export_error, costs=costs,
                 bandwidths=bandwidths, floor_ms=floor_ms, target_bytes=target_bytes,
                 base_ms=base_ms, ablations=ablations,
                 context=context, seconds=time.time() - started,
                 draft_card=smollm2_draft.read()[2])
  benchmarking.write_report(with_spec_bench_section(render(summary)), _OUTPUT.value)


def with_spec_bench_section(report: str) -> str:
  """`report` followed by the Spec-Bench section of the report now at --output, if it has
  one (a demo run keeps the last Spec-Bench run's table)."""
  if not os.path.isfile(_OUTPUT.value):
    return report
  with open(_OUTPUT.value, encoding='utf-8') as f:
    kept = spec_bench_methods.split_section(f.read())[1]
  return report if not kept else report.rstrip('\n') + '\n\n' + kept.rstrip('\n') + '\n'


def per_category(cases, categories) -> dict[str, dict[str, Any]]:
  """Batch-1 figures per prompt category: round k decoded prompt k mod (number of prompts)."""
  table = {}
  for category in dict.fromkeys(categories):
    rounds = [k for k in range(_ROUNDS.value) if categories[k % len(categories)] == category]
    if not rounds:
      continue
    row = {'rounds': len(rounds)}
    for temperature in (0.0, 1.0):
      base = find(cases, 'speclm baseline', 1, temperature)
      for name, label in (('speclm speculative', 'fixed'), ('speclm adaptive γ', 'adaptive')):
        case = find(cases, name, 1, temperature)
        if case is None:
          continue
        row[(label, temperature)] = dict(
            speedup=median([base.seconds[k] / case.seconds[k] for k in rounds]),
            alpha=sum(float(case.stats[k].beta_sum) for k in rounds) / max(
                1, sum(int(case.stats[k].beta_count) for k in rounds)),
            tokens_per_call=case.new_tokens * len(rounds) / max(
                1, sum(int(case.stats[k].target_calls) for k in rounds)))
    ttft = find(cases, 'time to first token, baseline', 1, 0.0)
    row['ttft_ms'] = median([1e3 * ttft.seconds[k] for k in rounds])
    table[category] = row
  return table


def gamma_histograms(cases) -> dict[str, list[int]]:
  """Rounds by tokens drafted, summed over every round of each speculative case."""
  out = {}
  for case in cases:
    # A baseline's histogram has one entry; an adaptive batch that never drafted still counts.
    if case.stats and case.new_tokens > 1 and np.size(case.stats[0].gamma_histogram) > 1:
      total = sum(np.asarray(s.gamma_histogram) for s in case.stats)
      out[f'{case.name}, batch {case.batch_size}, T={case.temperature:g}'] = total.tolist()
  return out


def _cut() -> str:
  n = _TARGET_LAYERS.value
  return f'; SMOKE RUN: only its first {n} layers, timings meaningless' if n else ''


def render(s: dict) -> str:
  lines = benchmarking.report_header('Benchmarks', 'scripts/benchmark.py', s['seconds']) + [
      '- models: SmolLM2-135M-Instruct (float32, dequantized from the shipped Q4_1 GGUF'
      f'{_cut()}) and'
      f' the shipped {s["draft_card"].get("num_layers")}-layer draft'
      f' ({s["draft_card"].get("subset_size")}-token head)' + (
          f', with prompt lookup taking over where the last {_LOOKUP_MIN_NGRAM.value}+ tokens'
          ' occurred before (as in the demo; Hugging Face\'s assistant is the trained draft'
          ' alone, since assisted generation takes one or the other)'
          if _LOOKUP_MIN_NGRAM.value else ''),
      f'- settings: γ = {_GAMMA.value} at batch 1 and {_gamma(_BATCH.value)} at batch'
      f' {_BATCH.value}, {_MAX_NEW.value} new tokens per row (end token ignored),'
      f' {_ROUNDS.value} interleaved rounds; batch-1 cases decode demo prompt k in round k;'
      f' batch {_BATCH.value} decodes all {_BATCH.value} demo prompts; Hugging Face runs'
      f' PyTorch on {_THREADS.value} threads, float32, same weights, assisted generation with'
      f' {_GAMMA.value} constant assistant tokens',
      '- workload: the 8 built-in demo prompts; prompts padded to multiples of 128 tokens',
      '',
  ]
  lines += benchmarking.time_table(s['cases'])
  lines += ['', '## Ratios (median of per-round ratios) and the targets', '',
            '| ratio | measured | target | met |', '| --- | --- | --- | --- |']
  for name, value in s['ratios'].items():
    target = TARGETS.get(name)
    met = '' if target is None or value is None else ('yes' if value >= target else 'no')
    lines.append(f'| {name} | {fmt(value)}× | {fmt(target)}{"×" if target else ""} | {met} |')
  floor_ratio = benchmarking.floor_ratio(s['base_ms'], s['floor_ms'])
  lines += [
      f'| baseline time / memory-bandwidth floor, batch 1 | {floor_ratio:.2f}× | ≤ 1.60× |'
      f' {"yes" if floor_ratio <= 1.6 else "no"} |',
      '',
  ]
  lines += render_adaptive(s)
  lines += [
      '## Against the theory (generalised Theorem 3.8: (1 − α^(γ+1)) / ((1 − α)(γc + r)))',
      '',
      '| setting | α | c | r | predicted | measured | measured / predicted | per row:'
      ' predicted | measured / predicted per row | Thm 3.8 with r = 1 |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |',
  ]
  for name, p in s['predictions'].items():
    rel, rel_row = ((None, None) if p['measured'] is None else
                    (p['measured'] / p['predicted'], p['measured'] / p['per_row']))
    lines.append(f'| {name} | {p["alpha"]:.3f} | {p["c"]:.3f} | {p["r"]:.2f} |'
                 f' {p["predicted"]:.2f}× | {fmt(p["measured"])}× | {fmt(rel)} |'
                 f' {p["per_row"]:.2f}× | {fmt(rel_row)} | {p["theorem_3_8_r1"]:.2f}× |')
  lines += [
      '',
      f'c and r are timed on the compiled `extend` calls at context {s["context"]}'
      ' (`speclm.run.calibration.measure_costs`); α is the exact β average of the'
      ' speculative runs above. "Per row" applies the theorem to finite generations row by'
      ' row (`speclm.analysis.theory.batch_walltime_improvement`): each round\'s prediction'
      f' uses the α of each of its rows and the {_MAX_NEW.value} − 1 tokens the rounds make,'
      ' and a batch runs until its slowest row is done; the median over rounds is shown.',
      '',
  ]
  lines += benchmarking.floor_section(
      s['bandwidths'], s['floor_ms'], s['base_ms'],
      'bytes the target reads per batch-1 call (weights, one embedding row, keys and values at'
      f' context {s["context"]}): {s["target_bytes"] / 1e6:.0f} MB')
  lines += ['', '## Exactness checks', ''] + benchmarking.check_lines(s['checks'])
  if s['hf_agreement'] is not None:
    a = s['hf_agreement']
    lines.append('- our greedy baseline vs HF greedy `generate()`:'
                 f' {100 * a["token_agreement"]:.1f}%'
                 f' of tokens equal; identical prefix per round: {a["identical_prefix"]}'
                 ' (float32 sums in another order can flip a near-tie, after which texts part)')
  if s['export_error'] is not None:
    lines.append(f'- HF export of the draft: max |logit difference| {s["export_error"]:.1e}')
  if s['ablations']:
    lines += ['', '## What the optimisations moved (interleaved in the same run)', '',
              '| before | batch | T | ms / token before | after | speedup |',
              '| --- | --- | --- | --- | --- | --- |']
    for a in s['ablations']:
      lines.append(f'| {a["change"]} | {a["batch_size"]} | {a["temperature"]:g} |'
                   f' {a["before_ms"]:.1f} | {a["after_ms"]:.1f} | {fmt(a["speedup"])}× |')
  lines.append('')
  return '\n'.join(lines)


def render_adaptive(s: dict) -> list[str]:
  """Per-category table (fixed vs adaptive γ), the γ histograms and the adaptive rule."""
  lines = ['## Per category (batch 1; median of per-round ratios over the rounds of each'
           ' category)', '',
           '| category | rounds | time to first token, ms | T | fixed γ: speculative /'
           ' baseline | α | tokens / call | adaptive γ: speculative / baseline | α |'
           ' tokens / call |', '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for category, row in s['per_category'].items():
    for temperature in (0.0, 1.0):
      cells = []
      for label in ('fixed', 'adaptive'):
        entry = row.get((label, temperature))
        cells += (['', '', ''] if entry is None else
                  [f'{entry["speedup"]:.2f}×', f'{entry["alpha"]:.3f}',
                   f'{entry["tokens_per_call"]:.2f}'])
      lines.append(f'| {category} | {row["rounds"]} | {row["ttft_ms"]:.0f} | {temperature:g} | '
                   + ' | '.join(cells) + ' |')
  lines += ['', '## Rounds by γ (tokens drafted per round, 0 … γ_max)', '']
  lines += [f'- {name}: {histogram}' for name, histogram in s['gamma_histograms'].items()]
  if s['rules']:
    lines += ['', 'Adaptive rule (`speclm.adaptive.AdaptiveGamma`, costs timed by'
              ' `calibration.measure_adaptive_gamma`, cached per machine and batch size):', '']
    for batch_size, rule in s['rules'].items():
      lines.append(f'- batch {batch_size}: γ_max {rule.max_gamma}, c {rule.draft_cost:.3f},'
                   f' r(0 … γ_max) {", ".join(f"{r:.2f}" for r in rule.verify_costs)},'
                   f' prior α {rule.prior_alpha}, decay {rule.decay}, draft stopping'
                   f' {"on" if rule.draft_stopping else "off"}, max skip {rule.max_skip}')
  lines.append('')
  return lines


if __name__ == '__main__':
  app.run(main)
