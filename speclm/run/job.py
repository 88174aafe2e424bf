"""The decoding job: `run_job` decodes a dataset into an output directory, `run_sweep` runs it
at several temperatures.

`run_job` is gin's surface; the job itself is a sequence of phases, each a function below:

  1. settings     every argument validated (`speclm.run.settings`), before anything is touched
  2. output dir   locked, checked against the job's fingerprint (`speclm.run.fingerprint`)
  3. inputs       the vocabulary and this process's share of the dataset
  4. models       the target and draft (`speclm.run.providers`), sharded when a mesh is set
  5. calibration  adaptive γ's costs (`speclm.run.calibration`, cached per machine)
  6. accept       the full fingerprint recorded; only now does the directory change
  7. tree policy  the chain or a tree, timed on batches of spread lengths (`@tree_policy()`)
  8. decode       batch by batch (`speclm.run.records`), each batch appended durably; a
                 conversational dataset's later turns after the earlier replies (`speclm.run.turns`)
  9. report       metrics.json over every recorded example (`speclm.analysis.job_metrics`)
Several processes each decode their share and process 0 merges (`speclm.run.merge`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

import gin
import jax
import numpy as np

from speclm import adaptive
from speclm import decoding
from speclm import outputs as outputs_lib
from speclm import partitioning
from speclm import progress as progress_lib
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm.analysis import job_metrics
from speclm.checkpoints import memory
from speclm.run.calibration import costs as costs_lib
from speclm.run.calibration import tree_policy as tree_policy_lib
from speclm.data import inputs as inputs_lib
from speclm.data import vocab as vocab_lib
from speclm.run import fingerprint as fingerprint_lib
from speclm.run import gin_cli
from speclm.run import merge as merge_lib
from speclm.run import providers
from speclm.run import records as records_lib
from speclm.run import settings as settings_lib
from speclm.run import turns as turns_lib
from speclm.run.errors import BadLogitsError
from speclm.run.errors import Interrupted
from speclm.run.errors import JobError
from speclm.run.gin_cli import warn

MODES = settings_lib.MODES
ON_BAD_LOGITS = settings_lib.ON_BAD_LOGITS
ADAPTIVE = settings_lib.ADAPTIVE


@dataclasses.dataclass(frozen=True)
class _Process:
  """This process's place in a multi-process job (one process: index 0 of 1)."""

  index: int
  count: int

  def job_dir(self, output_dir: str) -> str:
    """Where this process writes: `output_dir`, or its `process_<p>/` with several."""
    return output_dir if self.count == 1 else os.path.join(output_dir,
                                                           merge_lib.process_dir(self.index))


@dataclasses.dataclass(frozen=True)
class _Inputs:
  """The job's vocabulary and this process's examples, before and after encoding."""

  vocabulary: vocab_lib.Vocabulary
  examples: list[inputs_lib.Example]
  encoded: list[inputs_lib.EncodedExample] | None = None
  input_limit: int | None = None


@dataclasses.dataclass(frozen=True)
class _Pair:
  """The loaded models (the draft None when no method speculates)."""

  target: protocol.Model
  draft: protocol.Model | None


@dataclasses.dataclass(frozen=True)
class _Decoding:
  """How the speculative method decodes, as chosen before the first batch."""

  gamma: Any  # γ, or the adaptive rule
  rule: adaptive.AdaptiveGamma | None = None
  tree: Any = None
  policy_record: dict[str, Any] | None = None
  speculate: bool = True


@gin.configurable(denylist=['progress_stream'])
def run_job(*,
            mode: str = 'speculative',
            target: Any = gin.REQUIRED,
            draft: Any = None,
            vocabulary: Any = gin.REQUIRED,
            dataset: Any = gin.REQUIRED,
            output_dir: str = gin.REQUIRED,
            gamma: int | str = 4,
            max_gamma: int = 4,
            draft_stopping: bool = False,
            prior_alpha: float = 0.5,
            tree: Any = None,
            sampling: Any = sampling_lib.GREEDY,
            max_new_tokens: int = 64,
            batch_size: int = 8,
            seed: int = 0,
            max_input_length: int = 512,
            length_buckets: Sequence[int] | None = None,
            on_too_long: str = 'truncate',
            add_eos_to_inputs: bool = False,
            max_examples: int | None = None,
            exclude_compile_time: bool = True,
            measure_cost: bool = True,
            reference_metrics: Sequence[str] = ('bleu', 'rouge'),
            show_progress: bool = True,
            partitioner: Any = None,
            overwrite: bool = False,
            on_bad_logits: str = 'fail',
            progress_stream=None) -> dict[str, Any]:
  """Decodes a dataset and writes predictions and metrics to `output_dir`; returns the metrics.

  Args:
    mode: 'speculative', 'baseline' or 'compare'.
    target, draft: model providers (the draft is unused by 'baseline').
    vocabulary: a vocabulary provider; its end token stops generation.
    dataset: a dataset provider. Conversations (`@spec_bench_dataset`, one example per turn)
      are decoded turn by turn, a later turn after each method's own reply to the earlier one,
      rendered with the vocabulary's chat template (`speclm.run.turns`); their records carry
      'category' and 'turn', and metrics.json a table by category.
    output_dir: where outputs go; a directory holding a killed run of the same job is resumed.
      A directory holding a different job (any setting in its job.json fingerprint differs,
      `speclm.run.fingerprint`) is refused before anything in it changes.
    gamma: tokens drafted per target call (γ), or 'adaptive': γ chosen every round from the
      running α, c and r(γ) (`speclm.adaptive`; c and r timed once per machine, model pair
      and batch size, then cached).
    max_gamma, draft_stopping, prior_alpha: with gamma = 'adaptive', the largest γ, whether
      the draft may stop early (or go on up to max_gamma) on its own confidence, and the α a
      row is assumed to have before any evidence. Where the rule chooses γ = 0 at that prior
      (a batch too wide for speculation to pay) it never drafts, and the job decodes with the
      baseline loop (`speclm.adaptive.never_drafts`).
    tree: a token tree (`@token_tree()` static, `@dynamic_tree()` EAGLE-2; see
      `speclm.token_trees`): each round verifies the tree in one target call instead of a
      chain of γ (`speclm.tree_decoding`), and `gamma` is unused. One device only. Or
      `@tree_policy()` (`speclm.run.calibration.tree_policy`): at start-up the job times the chain
      (with `gamma`) and each candidate tree on a few of its batches, spread over its prompt
      lengths, and decodes with the fastest as measured; metrics.json records the table
      under 'tree_policy'. One process only.
    sampling: `speclm.SamplingConfig`, or a provider of one (`@sampling_config`); temperature
      0 is greedy.
    max_new_tokens: generation limit per example.
    batch_size: rows decoded together; short batches are padded to it.
    seed: base seed; each batch uses seed + its first example's index, in both methods.
    max_input_length, length_buckets, on_too_long, add_eos_to_inputs: input encoding (see
      `speclm.data.inputs.encode_examples`); buckets default to
      `speclm.data.inputs.default_buckets` (powers of two to 512, then four a doubling).
      When the target (or draft) has a known context length, inputs are also held to that
      context less `max_new_tokens`, by the same `on_too_long` rule.
    max_examples: decode only the first N examples.
    exclude_compile_time: run each new batch shape once untimed first, so wall times (and the
      speedup) measure decoding, not XLA compilation.
    measure_cost: time one draft step against one target step to report c (and r, the cost of
      verifying γ+1 tokens relative to one) for Theorem 3.8's prediction.
    reference_metrics: 'bleu' (sacrebleu) and/or 'rouge' (rouge-score), computed when the
      examples have references and the package is installed.
    show_progress: print a progress bar with rate and ETA.
    partitioner: a `speclm.partitioning.Partitioner` (or a provider of one, e.g.
      `@partitioning.Partitioner()`): models are sharded over its mesh (the draft by its draft
      rules) and decoded with its shardings. None: one device.
    overwrite: discard whatever outputs `output_dir` holds and decode everything anew.
    on_bad_logits: rows that stopped on non-finite logits (`StopReason.BAD_LOGITS`) are counted
      in metrics.json and warned about in the summary; 'fail' (default) then raises
      `BadLogitsError` (the command exits 1), 'warn' only warns.

  Several processes (after `partitioning.initialize_distributed`): process p decodes the
  examples at positions p, p + P, p + 2P, … into `output_dir/process_<p>/`; after a barrier
  process 0 merges every part into `output_dir/predictions.jsonl` and writes the report.
  """
  job_start = time.perf_counter()
  settings = settings_lib.validate(
      mode=mode, draft=draft, output_dir=output_dir, gamma=gamma, max_gamma=max_gamma,
      draft_stopping=draft_stopping, prior_alpha=prior_alpha, tree=tree, sampling=sampling,
      max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
      max_input_length=max_input_length, length_buckets=length_buckets, on_too_long=on_too_long,
      add_eos_to_inputs=add_eos_to_inputs, max_examples=max_examples,
      exclude_compile_time=exclude_compile_time, measure_cost=measure_cost,
      reference_metrics=reference_metrics, show_progress=show_progress,
      partitioner=partitioner, overwrite=overwrite, on_bad_logits=on_bad_logits)
  process = _Process(jax.process_index(), jax.process_count())
  if settings.policy is not None and process.count > 1:
    raise JobError('run_job.tree = @tree_policy() calibrates on one process\'s batches, so'
                   ' processes could choose different trees; set a fixed tree (@token_tree(),'
                   ' @dynamic_tree()) for several processes.')
  stream = progress_stream or sys.stderr
  out = _open_output_dir(process.job_dir(output_dir), settings.overwrite)
  recorded_this_run = [0]  # examples appended by this run, for an interrupt's message
  try:
    inputs = _read_inputs(settings, vocabulary, dataset, process)
    fingerprint = _check_output_dir(out, settings, inputs.examples)
    pair = _load_pair(settings, target, draft, partitioner, process, inputs.vocabulary, stream)
    inputs = _encode_inputs(settings, inputs, pair)
    rule = _calibrate_gamma(settings, pair, inputs, stream)
    done = _accept_output_dir(out, fingerprint, pair)
    _report_truncation(inputs, done, settings.max_input_length, progress_stream)
    batches, num_done = _plan_batches(settings, out, inputs, done, output_dir, stream)
    choice = _choose_decoding(settings, out, batches, pair, inputs.vocabulary, rule, stream)
    compile_s = _decode_batches(settings, out, batches, pair, inputs, choice, num_done,
                                recorded_this_run, partitioner, progress_stream)
    metrics = _report(settings, out, pair, inputs, choice, partitioner, process,
                      job_start=job_start, compile_s=compile_s,
                      decoded_this_run=recorded_this_run[0], resumed_from=len(done))
  except KeyboardInterrupt:
    raise Interrupted(f'interrupted after {recorded_this_run[0]} examples; rerun the same'
                      ' command to resume.') from None
  finally:
    out.close()
  if process.count > 1:
    metrics = merge_lib.merge_processes(
        output_dir, process.index, process.count, metrics, mode=settings.mode,
        gamma=settings.describe_gamma(choice.tree), sampling=settings.sampling, tree=choice.tree,
        reference_metrics=settings.reference_metrics)
  print(job_metrics.summary(metrics))
  _check_bad_logits(metrics, settings.on_bad_logits, output_dir)
  return metrics


# ----------------------------------------------------------------------------------------------
# The phases, in the order `run_job` calls them.


def _open_output_dir(job_dir: str, overwrite: bool) -> outputs_lib.OutputDir:
  """Phase 2a: the output directory, locked. Nothing in it is written until the job has
  accepted it (`_accept_output_dir`), except what `overwrite` discards."""
  try:
    out = outputs_lib.OutputDir(job_dir)
  except outputs_lib.OutputError as e:
    raise JobError(str(e)) from None
  if overwrite:
    try:
      deleted = out.discard()
    except BaseException:
      out.close()
      raise
    if deleted:
      warn(f'run_job.overwrite: discarded {", ".join(deleted)} in {job_dir}.')
  return out


def _read_inputs(settings: settings_lib.JobSettings, vocabulary, dataset,
                 process: _Process) -> _Inputs:
  """Phase 3: the vocabulary and this process's share of the examples (process p takes the
  examples at positions p, p + P, …)."""
  gin_cli.check_model_paths()  # a missing checkpoint is reported before the vocabulary loads
  vocabulary = providers.as_vocabulary(providers.provide(vocabulary, 'Loading the vocabulary'))
  examples = list(providers.provide(dataset, 'Reading the dataset'))
  if settings.max_examples is not None:
    examples = examples[:settings.max_examples]
  if process.count > 1:  # this process's share; process 0 merges the parts
    examples = examples[process.index::process.count]
  if not examples:
    raise JobError('The dataset is empty: no examples to decode. Check the dataset path,'
                   ' format and filters (file_dataset.path, seqio_dataset.split,'
                   ' run_job.max_examples).')
  turns_lib.check_inputs(examples, vocabulary, process.count)
  return _Inputs(vocabulary=vocabulary, examples=examples)


def _check_output_dir(out: outputs_lib.OutputDir, settings: settings_lib.JobSettings,
                      examples) -> dict[str, Any]:
  """Phase 2b: the fingerprint known before the models load, checked against the directory's
  (a directory of another job is refused before the slow model loading)."""
  fingerprint = fingerprint_lib.job_fingerprint(settings.fingerprint_entries(),
                                                inputs_lib.fingerprint(examples), len(examples))
  try:
    out.check(fingerprint, partial=True)
  except outputs_lib.OutputError as e:
    raise JobError(str(e)) from None
  return fingerprint


def _load_pair(settings: settings_lib.JobSettings, target, draft, partitioner,
               process: _Process, vocabulary: vocab_lib.Vocabulary, stream) -> _Pair:
  """Phase 4: the target and (when a method speculates) the draft, placed in their shards
  when a partitioner is set, and checked against the vocabulary and each other; prints the
  bytes of the weights each holds."""
  if partitioner is not None:
    partitioner = providers.provide(partitioner, 'Building the device mesh',
                                    partitioning.Partitioner)
    if process.count > 1 and not partitioner.is_local:
      raise JobError(
          'partitioning.Partitioner.devices is global, but each process decodes its own'
          ' share of the dataset; a mesh over several processes needs the same batches on'
          " every process. Use devices = 'local' (one model replica per host).")
  target_model = providers.provide(target, 'Loading the target model', protocol.Model,
                                   partitioner=partitioner, role='target')
  draft_model = (providers.provide(draft, 'Loading the draft model', protocol.Model,
                                   partitioner=partitioner, role='draft')
                 if settings.speculates else None)
  if partitioner is not None:
    target_model = _ensure_sharded(partitioner, target_model, 'target')
    draft_model = (None if draft_model is None
                   else _ensure_sharded(partitioner, draft_model, 'draft'))
  if vocabulary.vocab_size > target_model.vocab_size:
    raise JobError(f'The vocabulary has {vocabulary.vocab_size} ids but the target model'
                   f' only {target_model.vocab_size}; they do not belong together.')
  if draft_model is not None:
    try:
      decoding.check_pair(target_model, draft_model)
    except ValueError as e:
      raise JobError(str(e)) from None
  held = [memory.describe('target', target_model.params)]
  if draft_model is not None:
    held.append(memory.describe('draft', draft_model.params))
  print(f'Weights as held: {", ".join(held)}.', file=stream, flush=True)
  return _Pair(target=target_model, draft=draft_model)


def _encode_inputs(settings: settings_lib.JobSettings, inputs: _Inputs, pair: _Pair) -> _Inputs:
  """Phase 4b: the examples as token ids, held to the input limit (`_input_limit`); of a
  conversational dataset, the first turns (later ones are encoded after the earlier replies,
  `speclm.run.turns`)."""
  input_limit = _input_limit(settings.max_input_length, settings.max_new_tokens, pair.target,
                             pair.draft)
  try:
    encoded = inputs_lib.encode_examples(
        turns_lib.first_turns(inputs.examples), inputs.vocabulary, max_input_length=input_limit,
        on_too_long=settings.on_too_long, add_eos=settings.add_eos_to_inputs)
  except inputs_lib.DataError as e:
    raise JobError(str(e)) from None
  return dataclasses.replace(inputs, encoded=encoded, input_limit=input_limit)


def _calibrate_gamma(settings: settings_lib.JobSettings, pair: _Pair, inputs: _Inputs,
                     stream) -> adaptive.AdaptiveGamma | None:
  """Phase 5: with gamma = 'adaptive', the rule with c and r(γ) timed on this machine (or read
  from the cost cache); None otherwise."""
  if not settings.adaptive or pair.draft is None:
    return None
  batch_size, max_gamma = settings.batch_size, settings.max_gamma
  print(f'Timing c and r(γ) for adaptive γ (batch {batch_size}, γ ≤ {max_gamma}; cached'
        ' per machine) …', file=stream, flush=True)
  rule = costs_lib.measure_adaptive_gamma(
      pair.target, pair.draft, max_gamma=max_gamma, batch_size=batch_size,
      context_length=_cost_context(inputs.encoded, settings.max_new_tokens, settings.buckets),
      draft_stopping=settings.draft_stopping, prior_alpha=settings.prior_alpha)
  if adaptive.never_drafts(rule):
    print(f'Adaptive γ: at the prior α {rule.prior_alpha:g} drafting does not pay at batch'
          f' {batch_size} (c {rule.draft_cost:.3f}, r(0 … {max_gamma})'
          f' {", ".join(f"{r:.2f}" for r in rule.verify_costs)}), so no round would draft:'
          ' the baseline loop decodes. A higher run_job.prior_alpha makes it try.',
          file=stream, flush=True)
  return rule


def _accept_output_dir(out: outputs_lib.OutputDir, fingerprint: dict[str, Any],
                       pair: _Pair) -> dict[int, dict[str, Any]]:
  """Phase 6: the full fingerprint (models included) is recorded or matched, and only now does
  anything in the directory change. Returns the examples already recorded, by index."""
  fingerprint = dict(fingerprint, **fingerprint_lib.model_entries({'target': pair.target,
                                                                   'draft': pair.draft}))
  try:
    done = out.resume(fingerprint)
  except outputs_lib.OutputError as e:
    raise JobError(str(e)) from None
  outputs_lib.write_atomic(out.file(outputs_lib.CONFIG), gin.config_str())
  return done


def _plan_batches(settings: settings_lib.JobSettings, out: outputs_lib.OutputDir,
                  inputs: _Inputs, done, output_dir: str,
                  stream) -> tuple[list[inputs_lib.Batch], int]:
  """Phase 6b: examples skipped by the length rule are recorded once, like decoded ones; the
  rest not yet recorded are batched. Returns the batches and the examples already done."""
  skipped = [e for e in inputs.encoded if e.skipped and e.example.index not in done]
  if skipped:
    out.append([records_lib.base_record(e) for e in skipped])
  pending = [e for e in inputs.encoded if not e.skipped and e.example.index not in done]
  batches = inputs_lib.make_batches(pending, batch_size=settings.batch_size,
                                    buckets=settings.buckets, pad_id=inputs.vocabulary.pad_id)
  if done:
    print(f'Resuming {output_dir}: {len(done)} of {len(inputs.examples)} examples already'
          ' recorded.', file=stream)
  return batches, (len(inputs.examples) - len(pending)
                   - turns_lib.pending_later(inputs.examples, done))


def _choose_decoding(settings: settings_lib.JobSettings, out: outputs_lib.OutputDir, batches,
                     pair: _Pair, vocabulary, rule, stream) -> _Decoding:
  """Phase 7: how the speculative method decodes: the adaptive rule, the fixed γ or tree, or
  what a tree policy chose on pending batches spread over the prompt lengths."""
  if settings.policy is None:
    return _Decoding(gamma=rule or settings.gamma, rule=rule, tree=settings.tree)
  tree, record = _apply_policy(settings.policy, out, batches, pair.target, pair.draft,
                               gamma=settings.gamma, sampling=settings.sampling,
                               seed=settings.seed,
                               vocabulary=vocabulary, stream=stream)
  return _Decoding(gamma=settings.gamma, tree=tree, policy_record=record,
                   speculate=record.get('chosen') != tree_policy_lib.BASELINE)


def _decode_batches(settings: settings_lib.JobSettings, out: outputs_lib.OutputDir, batches,
                    pair: _Pair, inputs: _Inputs, choice: _Decoding, num_done: int,
                    recorded_this_run: list[int], partitioner, progress_stream) -> float:
  """Phase 8: every batch decoded by each method and appended (durably) to the predictions;
  then a conversational dataset's later turns, turn by turn (`speclm.run.turns`). Returns the
  compile-and-warm-up seconds; counts appended examples in `recorded_this_run`. Ctrl-C
  becomes `Interrupted` with the count of recorded examples."""
  methods = settings.methods
  bar = progress_lib.Progress(len(inputs.examples), initial=num_done, stream=progress_stream,
                              enabled=settings.show_progress,
                              label='compare' if settings.mode == 'compare' else methods[0])
  warmed: set[tuple[str, tuple[int, ...]]] = set()
  compile_s = [0.0]

  def record(records, tokens: int) -> None:
    out.append(records)
    recorded_this_run[0] += len(records)
    bar.update(len(records), tokens)

  def decode(batch, method_batches=None) -> None:
    records, batch_compile_s = records_lib.decode_batch(
        batch, methods, pair.target, pair.draft, inputs.vocabulary, warmed,
        exclude_compile_time=settings.exclude_compile_time, gamma=choice.gamma,
        sampling=settings.sampling, max_new_tokens=settings.max_new_tokens,
        seed=settings.seed + batch.examples[0].example.index, partitioner=partitioner,
        tree=choice.tree, speculate=choice.speculate, method_batches=method_batches)
    compile_s[0] += batch_compile_s
    record(records, sum(r[methods[-1]]['num_tokens'] for r in records))

  try:
    for batch in batches:
      decode(batch)
    turns_lib.decode_later_turns(
        inputs.examples, lambda: outputs_lib.read_predictions(out.predictions_path),
        lambda records: record(records, 0),
        lambda method_batches: decode(method_batches[methods[-1]], method_batches),
        records_lib.base_record, inputs.vocabulary, methods, input_limit=inputs.input_limit,
        on_too_long=settings.on_too_long, batch_size=settings.batch_size,
        buckets=settings.buckets)
  except KeyboardInterrupt:
    bar.close()
    # Counted from the file: Ctrl-C may land after a batch's write, before it was counted.
    recorded = len(outputs_lib.read_predictions(out.predictions_path))
    raise Interrupted(
        f'interrupted after {recorded - num_done} examples ({recorded} of'
        f' {len(inputs.examples)} recorded in {out.path}); rerun the same command to resume.'
    ) from None
  bar.close()
  return compile_s[0]


def _report(settings: settings_lib.JobSettings, out: outputs_lib.OutputDir, pair: _Pair,
            inputs: _Inputs, choice: _Decoding, partitioner, process: _Process, *,
            job_start: float, compile_s: float, decoded_this_run: int,
            resumed_from: int) -> dict[str, Any]:
  """Phase 9: metrics.json over every recorded example, this run's and earlier runs'."""
  metrics = job_metrics.compute_metrics(
      outputs_lib.read_predictions(out.predictions_path), mode=settings.mode,
      gamma=settings.describe_gamma(choice.tree), sampling=settings.sampling,
      cost=_cost_entry(settings, pair, inputs, choice), tree=choice.tree,
      reference_metrics=settings.reference_metrics)
  if choice.policy_record is not None:
    metrics['tree_policy'] = choice.policy_record
    metrics['speculation'] = 'on' if choice.speculate else (
        'off: the tree policy measured the baseline fastest, so the speculative method'
        ' decoded without a draft')
  metrics['job'] = {'wall_time_s': time.perf_counter() - job_start,
                    'compile_and_warmup_s': compile_s, 'batch_size': settings.batch_size,
                    'max_new_tokens': settings.max_new_tokens,
                    'length_buckets': list(settings.buckets), 'input_limit': inputs.input_limit,
                    'decoded_this_run': decoded_this_run, 'resumed_from': resumed_from,
                    'output_dir': out.path, 'process_index': process.index,
                    'process_count': process.count}
  if partitioner is not None:
    metrics['job']['mesh'] = partitioner.mesh_shape
  outputs_lib.write_json_atomic(out.file(outputs_lib.METRICS), metrics)
  outputs_lib.write_atomic(out.file(outputs_lib.OPERATIVE_CONFIG), gin.operative_config_str())
  return metrics


def _cost_entry(settings: settings_lib.JobSettings, pair: _Pair, inputs: _Inputs,
                choice: _Decoding) -> dict[str, Any] | None:
  """metrics.json's cost_measurement: the adaptive rule's costs, or c and r timed for Theorem
  3.8's prediction (a tree's verification costs about a chain's of as many rows), cached per
  machine (`costs.measure_costs_cached`)."""
  rule = choice.rule
  if rule is not None:
    return {'c': rule.draft_cost, 'r': None, 'r_by_gamma': list(rule.verify_costs),
            'max_gamma': rule.max_gamma, 'draft_stopping': rule.draft_stopping,
            'prior_alpha': rule.prior_alpha, 'never_drafts': adaptive.never_drafts(rule),
            'batch_size': settings.batch_size}
  if not (settings.measure_cost and pair.draft is not None and choice.speculate):
    return None
  estimate = costs_lib.measure_costs_cached(
      pair.target, pair.draft,
      gamma=settings.gamma if choice.tree is None else choice.tree.num_nodes,
      batch_size=settings.batch_size,
      context_length=_cost_context(inputs.encoded, settings.max_new_tokens, settings.buckets),
      num_steps=4, repeats=3)
  return estimate.to_dict()


def _check_bad_logits(metrics: dict[str, Any], on_bad_logits: str, output_dir: str) -> None:
  """Rows stopped on non-finite logits: `BadLogitsError` ('fail') or a warning ('warn')."""
  if not metrics.get('num_bad_logits'):
    return
  message = (f"{metrics['num_bad_logits']} of {metrics['num_decoded']} examples stopped on"
             ' non-finite (NaN/inf) logits (stop reason BAD_LOGITS; their outputs end before'
             f' it). Check the checkpoints for NaN/Inf; outputs are in {output_dir}.')
  if on_bad_logits == 'fail':
    raise BadLogitsError(message + " Set run_job.on_bad_logits = 'warn' to only warn.")
  warn(message)


# ----------------------------------------------------------------------------------------------
# Helpers of the phases


def _apply_policy(policy: tree_policy_lib.TreePolicy, out: outputs_lib.OutputDir,
                  batches: Sequence[inputs_lib.Batch], target, draft, *, gamma, sampling,
                  seed, vocabulary, stream) -> tuple[Any, dict[str, Any]]:
  """The tree a `@tree_policy()` job decodes with (None: the chain, or no speculation when the
  entry's 'chosen' is 'baseline') and its metrics entry.

  The choice is made once, on pending batches spread over the prompt lengths
  (`tree_policy.calibration_batches`), and recorded in the output directory
  (`outputs.TREE_POLICY`) before anything is decoded: a resumed job decodes with the tree its
  first run chose (the fingerprint already holds the policy), and one with nothing left to
  decode does not calibrate.
  """
  recorded = out.file(outputs_lib.TREE_POLICY)
  if os.path.exists(recorded):
    with open(recorded, encoding='utf-8') as f:
      entry = json.load(f)
    chosen = entry.get('chosen')
    if chosen in policy.candidates or (chosen == tree_policy_lib.BASELINE
                                       and policy.allow_baseline):
      print(f"Tree policy: decoding with {chosen}, as chosen when this job started"
            f' ({recorded}).', file=stream, flush=True)
      return policy.candidates.get(chosen), entry
  if not batches:
    return None, {'chosen': None, 'note': 'nothing was left to decode, so no calibration ran'}
  picked = [batches[i] for i in tree_policy_lib.calibration_batches(
      [b.tokens.shape[1] for b in batches], [b.num_real for b in batches],
      policy.calibration_rows)]
  rows = sum(b.num_real for b in picked)
  trees = sum(tree is not None for tree in policy.candidates.values())
  print(f'Tree policy: timing the baseline, the chain and {trees} tree(s) on {rows} row(s) in'
        f' {len(picked)} batch(es) of prompt widths {[b.tokens.shape[1] for b in picked]}'
        f' × {policy.calibration_tokens} tokens ({policy.repeats} timed repeats, each'
        ' compiled first) …', file=stream, flush=True)
  try:
    choice = tree_policy_lib.choose(
        policy, target, draft, [(b.tokens[:b.num_real], b.lengths[:b.num_real]) for b in picked],
        gamma=gamma, sampling=sampling, eos_id=list(vocabulary.end_ids) or None,
        pad_id=vocabulary.pad_id, seed=seed + picked[0].examples[0].example.index)
  except ValueError as e:
    raise JobError(f'run_job.tree = @tree_policy(): {e}') from None
  print(f'Tree policy: chose {choice.summary()}.', file=stream, flush=True)
  entry = choice.to_dict()
  outputs_lib.write_json_atomic(recorded, entry)
  return choice.tree, entry


def _cost_context(encoded, max_new_tokens: int, buckets: Sequence[int]) -> int:
  """The context c and r are timed at: the length bucket of the mean input (the padded width
  the decode loops attend over) plus half the new tokens, the average position a decode step
  works at. Jobs over inputs of one bucket time the same compiled calls and share the cost
  cache. (Timing at the smallest bucket instead measured r at 16 positions, where the
  per-token work outside the products weighs more.)"""
  lengths = [e.length for e in encoded if not e.skipped]
  mean = max(1, int(np.mean(lengths)) if lengths else 1)
  bucket = next((b for b in buckets if b >= mean), mean)
  return bucket + max_new_tokens // 2


def _input_limit(max_input_length: int, max_new_tokens: int, *models) -> int:
  """Input tokens allowed: `max_input_length`, and the shortest model context less the new
  tokens (models with no known context length do not limit it)."""
  contexts = [c for m in models if m is not None
              for c in [getattr(m.definition, 'max_context_length', None)] if c]
  if not contexts:
    return max_input_length
  room = min(contexts) - max_new_tokens
  if room < 1:
    raise JobError(f'run_job.max_new_tokens={max_new_tokens} leaves no room for an input in'
                   f' the model context of {min(contexts)} tokens; lower MAX_NEW_TOKENS.')
  return min(max_input_length, room)


def _report_truncation(inputs: _Inputs, done, max_input_length: int, stream) -> None:
  """One line on stderr when inputs were truncated (those not recorded before)."""
  input_limit = inputs.input_limit
  truncated = sum(1 for e in inputs.encoded if e.truncated and e.example.index not in done)
  if truncated:
    why = ('max_input_length' if input_limit == max_input_length else
           'the model context less max_new_tokens')
    print(f'{truncated} input(s) truncated to {input_limit} tokens ({why}).',
          file=stream or sys.stderr)


def _ensure_sharded(partitioner, model: protocol.Model, role: str) -> protocol.Model:
  """The model with parameters on the partitioner's mesh (providers that took the
  partitioner already placed them; others are sharded here from their host copy)."""
  leaves = jax.tree.leaves(model.params)
  mesh = partitioner.mesh
  if all(isinstance(x, jax.Array) and getattr(x.sharding, 'mesh', None) == mesh
         for x in leaves):
    return model
  return partitioner.shard_model(model, role)



@gin.configurable
def run_sweep(temperatures: Sequence[float] = gin.REQUIRED, output_dir: str = gin.REQUIRED,
              show_outputs: int = 0, progress_stream=None) -> dict[float, dict[str, Any]]:
  """Runs `run_job` once per temperature, into `output_dir/temperature_<T>`.

  Every other setting comes from `run_job`'s bindings; `show_outputs` prints that many decoded
  texts of each run (the embedded demo shows a few).
  """
  if not temperatures:
    raise JobError('run_sweep.temperatures is empty; give at least one, e.g. [0.0, 1.0].')
  results, bad = {}, []
  for temperature in temperatures:
    sub_dir = os.path.join(output_dir, f'temperature_{temperature:g}')
    print(f'\n=== temperature {temperature:g} -> {sub_dir}', file=progress_stream or sys.stdout)
    try:
      metrics = run_job(sampling=sampling_lib.SamplingConfig(  # pylint: disable=missing-kwoa
          temperature=float(temperature)), output_dir=sub_dir, progress_stream=progress_stream)
    except BadLogitsError as e:  # the other temperatures still run; the sweep fails at the end
      bad.append(f'temperature {temperature:g}: {e.message}')
      continue
    if show_outputs:
      method = 'speculative' if metrics['mode'] != 'baseline' else 'baseline'
      records = sorted(outputs_lib.read_predictions(os.path.join(sub_dir,
                                                                 outputs_lib.PREDICTIONS)),
                       key=lambda r: r['index'])
      for record in records[:show_outputs]:
        if method in record:
          print(f"\n> {record['input']}\n{record[method]['output'].strip()}",
                file=progress_stream or sys.stdout)
    results[float(temperature)] = metrics
  if bad:
    raise BadLogitsError(' '.join(bad))
  return results


def sweep_requested() -> bool:
  try:
    return gin.query_parameter('run_sweep.temperatures') is not None
  except ValueError:
    return False
