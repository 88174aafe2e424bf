"""The decoding job: `run_job` decodes a dataset into an output directory, `run_sweep` runs it
at several temperatures, `load_job` hands a job's models and prompts to other tools.

The job's steps: lock and check the output directory against the job's fingerprint
(`speclm.run.fingerprint`), load the vocabulary, dataset and models (`speclm.run.providers`),
accept the directory, decode batch by batch (each batch appended durably), then write the report
(`speclm.analysis.job_metrics`). Several processes each decode their share and process 0 merges.
"""

from __future__ import annotations

import functools
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
from speclm import token_trees
from speclm import tree_decoding
from speclm.analysis import job_metrics
from speclm.analysis import measure
from speclm.analysis import tree_policy as tree_policy_lib
from speclm.data import inputs as inputs_lib
from speclm.data import vocab as vocab_lib
from speclm.run import fingerprint as fingerprint_lib
from speclm.run import providers
from speclm.run.errors import BadLogitsError
from speclm.run.errors import Interrupted
from speclm.run.errors import JobError
from speclm.run import gin_cli
from speclm.run.gin_cli import warn

MODES = tuple(job_metrics.METHODS)


def _decode(method: str, target, draft, batch: inputs_lib.Batch, *, gamma, sampling,
            max_new_tokens, seed, eos_id, pad_id, partitioner=None, tree=None,
            speculate=True) -> decoding.DecodeResult:
  """One batch by `method`; `speculate=False` (a tree policy chose the baseline) decodes the
  'speculative' method without a draft."""
  common = dict(sampling=sampling, max_new_tokens=max_new_tokens, seed=seed, eos_id=eos_id,
                pad_id=pad_id, partitioner=partitioner)
  if method == 'speculative' and not speculate:
    result = decoding.autoregressive_decode(target, batch.tokens, batch.lengths, **common)
  elif method == 'speculative' and tree is not None:
    del common['partitioner']  # refused before decoding (run_job)
    result = tree_decoding.tree_speculative_decode(target, draft, batch.tokens, batch.lengths,
                                                   tree=tree, **common)
  elif method == 'speculative':
    result = decoding.speculative_decode(target, draft, batch.tokens, batch.lengths,
                                         gamma=gamma, **common)
  else:
    result = decoding.autoregressive_decode(target, batch.tokens, batch.lengths, **common)
  return jax.device_get(jax.block_until_ready(result))


def _decode_batch(batch: inputs_lib.Batch, methods: Sequence[str], target, draft,
                  vocabulary: vocab_lib.Vocabulary, warmed: set, *, exclude_compile_time: bool,
                  **decode_kwargs) -> tuple[list[dict[str, Any]], float]:
  """Decodes one batch with each method (same seed); returns its records and compile time."""
  results, times, compile_s = {}, {}, 0.0
  for method in methods:
    decode = functools.partial(_decode, method, target, draft, batch,
                               eos_id=list(vocabulary.end_ids) or None, pad_id=vocabulary.pad_id,
                               **decode_kwargs)
    key = (method, batch.tokens.shape)
    if exclude_compile_time and key not in warmed:  # compile (and warm up) untimed
      start = time.perf_counter()
      decode()
      compile_s += time.perf_counter() - start
      warmed.add(key)
    start = time.perf_counter()
    results[method] = decode()
    times[method] = time.perf_counter() - start
  token_lists = {m: results[m].to_lists() for m in methods}
  records = []
  for row, item in enumerate(batch.examples):  # padding rows (past num_real) are dropped
    record = _base_record(item)
    record['batch'] = batch.examples[0].example.index  # rows decoded together share it
    record['batch_rows'] = batch.num_real  # a resume redoes a batch recorded only in part
    for method in methods:
      record[method] = _row_record(method, results[method], row, token_lists[method][row],
                                   vocabulary, times[method] / batch.num_real)
    if 'baseline' in methods and 'speculative' in methods:
      record['identical'] = token_lists['baseline'][row] == token_lists['speculative'][row]
    record['output'] = record[methods[-1]]['output']
    records.append(record)
  return records, compile_s


def _row_record(method: str, result: decoding.DecodeResult, row: int, tokens: list[int],
                vocabulary: vocab_lib.Vocabulary, time_s: float) -> dict[str, Any]:
  stats = result.stats
  record = {
      'output': vocabulary.decode(tokens),
      'tokens': tokens,
      'num_tokens': len(tokens),
      'stop_reason': decoding.StopReason(int(result.stop_reasons[row])).name,
      'target_calls': int(stats.target_calls_per_row[row]),
      'time_s': time_s,
  }
  if method == 'speculative':
    record.update(accepted=int(stats.accepted_per_row[row]),
                  beta_sum=float(stats.beta_sum_per_row[row]),
                  beta_count=int(stats.beta_count_per_row[row]),
                  # Rounds of the row's batch by tokens drafted (the batch shares one γ).
                  gamma_histogram=np.asarray(stats.gamma_histogram).tolist())
    if stats.rank_offered is not None:  # a token tree: the batch's per-rank counts
      record.update(rank_offered=np.asarray(stats.rank_offered).tolist(),
                    rank_accepted=np.asarray(stats.rank_accepted).tolist())
  return record


ON_BAD_LOGITS = ('fail', 'warn')
ADAPTIVE = 'adaptive'  # run_job.gamma for `speclm.adaptive.AdaptiveGamma`


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
    dataset: a dataset provider.
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
      `@tree_policy()` (`speclm.analysis.tree_policy`): at start-up the job times the chain
      (with `gamma`) and each candidate tree on its first rows and decodes with the fastest
      as measured; metrics.json records the table under 'tree_policy'. One process only.
    sampling: `speclm.SamplingConfig`, or a provider of one (`@sampling_config`); temperature
      0 is greedy.
    max_new_tokens: generation limit per example.
    batch_size: rows decoded together; short batches are padded to it.
    seed: base seed; each batch uses seed + its first example's index, in both methods.
    max_input_length, length_buckets, on_too_long, add_eos_to_inputs: input encoding (see
      `speclm.data.inputs.encode_examples`); buckets default to powers of two up to the limit.
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
  if mode not in MODES:
    raise JobError(f"run_job.mode must be one of {MODES}, got {mode!r}.")
  if on_bad_logits not in ON_BAD_LOGITS:
    raise JobError(f'run_job.on_bad_logits must be one of {ON_BAD_LOGITS}, got'
                   f' {on_bad_logits!r}.')
  if on_too_long not in inputs_lib.ON_TOO_LONG:
    raise JobError(f'run_job.on_too_long must be one of {inputs_lib.ON_TOO_LONG}, got'
                   f' {on_too_long!r}.')
  methods = job_metrics.METHODS[mode]
  if mode != 'baseline' and draft is None:
    raise JobError(f"Mode {mode!r} needs a draft model: set run_job.draft (e.g. DRAFT ="
                   " @draft/random_llama), or use mode 'baseline'.")
  adaptive_gamma = gamma == ADAPTIVE
  try:
    gamma = (ADAPTIVE if adaptive_gamma else decoding.check_gamma(gamma))
    if adaptive_gamma:
      decoding.check_gamma(max_gamma)
  except ValueError as e:
    raise JobError(f"run_job.{'max_gamma' if adaptive_gamma else 'gamma'}: {e} (gamma may"
                   f" also be '{ADAPTIVE}').") from None
  if adaptive_gamma and (isinstance(prior_alpha, bool) or not isinstance(prior_alpha, (int, float))
                         or not 0.0 <= prior_alpha <= 1.0):
    raise JobError(f'run_job.prior_alpha must be a number in [0, 1], got {prior_alpha!r}.')
  policy = None  # a TreePolicy: the tree is chosen at start-up (step 4)
  if tree is not None:
    tree = providers.provide(tree, 'The token tree setting')
    if isinstance(tree, tree_policy_lib.TreePolicy):
      policy, tree = tree, None
    else:
      try:
        token_trees.check_tree(tree)
      except ValueError as e:
        raise JobError(f'run_job.tree: {e} (or a @tree_policy()).') from None
    if adaptive_gamma:
      raise JobError("run_job.tree and gamma = 'adaptive' exclude each other: a tree round"
                     ' has its own shape (and a tree policy times the chain at a fixed γ). Set'
                     ' GAMMA to an integer (--gin.GAMMA=3; demo.gin sets adaptive) or unset'
                     ' run_job.tree.')
    if partitioner is not None:
      raise JobError('run_job.tree runs on one device; unset run_job.partitioner.')
  sampling = providers.provide(sampling, 'The sampling setting', sampling_lib.SamplingConfig)
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise JobError(f'run_job.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.')
  buckets = tuple(sorted(length_buckets)) if length_buckets else inputs_lib.default_buckets(
      max_input_length)
  if buckets[-1] < max_input_length:
    raise JobError(f'The largest length bucket ({buckets[-1]}) is below max_input_length'
                   f' ({max_input_length}); add a bucket of at least that width.')

  process_index, process_count = jax.process_index(), jax.process_count()
  if policy is not None and 'speculative' not in methods:
    policy = None  # nothing to choose for the baseline alone
  if policy is not None and process_count > 1:
    raise JobError('run_job.tree = @tree_policy() calibrates on one process\'s first batch, so'
                   ' processes could choose different trees; set a fixed tree (@token_tree(),'
                   ' @dynamic_tree()) for several processes.')
  job_dir = output_dir if process_count == 1 else os.path.join(output_dir,
                                                                _process_dir(process_index))
  spec_gamma = gamma if tree is None else tree.describe()
  settings = {'mode': mode, 'gamma': spec_gamma if 'speculative' in methods else None,
              **({'tree': repr(tree)} if tree is not None and 'speculative' in methods else {}),
              **({'tree_policy': repr(policy)} if policy is not None else {}),
              **({'max_gamma': max_gamma, 'draft_stopping': bool(draft_stopping)}
                 if adaptive_gamma and 'speculative' in methods else {}),
              'temperature': sampling.temperature, 'top_k': sampling.top_k,
              'top_p': sampling.top_p, 'max_new_tokens': max_new_tokens, 'seed': seed,
              'batch_size': batch_size, 'max_input_length': max_input_length,
              'length_buckets': list(buckets), 'on_too_long': on_too_long,
              'add_eos_to_inputs': add_eos_to_inputs, 'max_examples': max_examples}

  # 1. The output directory: locked, then checked against what the job is about to do. Nothing
  #    in it is written until the job has accepted it (step 3).
  try:
    out = outputs_lib.OutputDir(job_dir)
  except outputs_lib.OutputError as e:
    raise JobError(str(e)) from None
  recorded_this_run = 0
  try:
    if overwrite:
      deleted = out.discard()
      if deleted:
        warn(f'run_job.overwrite: discarded {", ".join(deleted)} in {job_dir}.')
    gin_cli.check_model_paths()  # a missing checkpoint is reported before the vocabulary loads
    vocabulary = providers.as_vocabulary(providers.provide(vocabulary, 'Loading the vocabulary'))
    examples = list(providers.provide(dataset, 'Reading the dataset'))
    if max_examples is not None:
      examples = examples[:max_examples]
    if process_count > 1:  # this process's share; process 0 merges the parts
      examples = examples[process_index::process_count]
    if not examples:
      raise JobError('The dataset is empty: no examples to decode. Check the dataset path,'
                     ' format and filters (file_dataset.path, seqio_dataset.split,'
                     ' run_job.max_examples).')
    fingerprint = fingerprint_lib.job_fingerprint(settings, inputs_lib.fingerprint(examples),
                                                  len(examples))
    try:
      out.check(fingerprint, partial=True)  # before the (slow) model loading
    except outputs_lib.OutputError as e:
      raise JobError(str(e)) from None

    # 2. Models (placed in their shards when a partitioner is set).
    if partitioner is not None:
      partitioner = providers.provide(partitioner, 'Building the device mesh', partitioning.Partitioner)
      if process_count > 1 and not partitioner.is_local:
        raise JobError(
            'partitioning.Partitioner.devices is global, but each process decodes its own'
            ' share of the dataset; a mesh over several processes needs the same batches on'
            " every process. Use devices = 'local' (one model replica per host).")
    target_model = providers.provide(target, 'Loading the target model', protocol.Model,
                            partitioner=partitioner, role='target')
    draft_model = (providers.provide(draft, 'Loading the draft model', protocol.Model,
                            partitioner=partitioner, role='draft')
                   if 'speculative' in methods else None)
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
    input_limit = _input_limit(max_input_length, max_new_tokens, target_model, draft_model)
    try:
      encoded = inputs_lib.encode_examples(
          examples, vocabulary, max_input_length=input_limit, on_too_long=on_too_long,
          add_eos=add_eos_to_inputs)
    except inputs_lib.DataError as e:
      raise JobError(str(e)) from None
    rule = None
    if adaptive_gamma and draft_model is not None:
      print(f'Timing c and r(γ) for adaptive γ (batch {batch_size}, γ ≤ {max_gamma}; cached'
            ' per machine) …', file=progress_stream or sys.stderr, flush=True)
      rule = measure.measure_adaptive_gamma(
          target_model, draft_model, max_gamma=max_gamma, batch_size=batch_size,
          context_length=_cost_context(encoded, max_new_tokens), draft_stopping=draft_stopping,
          prior_alpha=float(prior_alpha))
      if adaptive.never_drafts(rule):
        print(f'Adaptive γ: at the prior α {rule.prior_alpha:g} drafting does not pay at batch'
              f' {batch_size} (c {rule.draft_cost:.3f}, r(0 … {max_gamma})'
              f' {", ".join(f"{r:.2f}" for r in rule.verify_costs)}), so no round would draft:'
              ' the baseline loop decodes. A higher run_job.prior_alpha makes it try.',
              file=progress_stream or sys.stderr, flush=True)

    # 3. The directory is accepted: the full fingerprint (models included) is recorded or
    #    matched, and only now does anything in it change.
    fingerprint.update(fingerprint_lib.model_entries({'target': target_model,
                                                      'draft': draft_model}))
    try:
      done = out.resume(fingerprint)
    except outputs_lib.OutputError as e:
      raise JobError(str(e)) from None
    outputs_lib.write_atomic(out.file(outputs_lib.CONFIG), gin.config_str())
    _report_truncation(encoded, done, input_limit, max_input_length, progress_stream)

    # 4. Examples skipped by the length rule are recorded once, like decoded ones.
    skipped = [e for e in encoded if e.skipped and e.example.index not in done]
    if skipped:
      out.append([_base_record(e) for e in skipped])
    pending = [e for e in encoded if not e.skipped and e.example.index not in done]
    batches = inputs_lib.make_batches(pending, batch_size=batch_size, buckets=buckets,
                                      pad_id=vocabulary.pad_id)
    num_done = len(examples) - len(pending)
    if done:
      print(f'Resuming {output_dir}: {len(done)} of {len(examples)} examples already recorded.',
            file=progress_stream or sys.stderr)
    policy_record, speculate = None, True
    if policy is not None:
      tree, policy_record = _apply_policy(
          policy, out, batches[0] if batches else None, target_model, draft_model,
          gamma=gamma, sampling=sampling, seed=seed, vocabulary=vocabulary,
          stream=progress_stream or sys.stderr)
      speculate = policy_record.get('chosen') != tree_policy_lib.BASELINE
      spec_gamma = gamma if tree is None else tree.describe()
    bar = progress_lib.Progress(len(examples), initial=num_done, stream=progress_stream,
                                enabled=show_progress,
                                label='compare' if mode == 'compare' else methods[0])
    warmed: set[tuple[str, tuple[int, ...]]] = set()
    compile_s = 0.0
    try:
      for batch in batches:
        records, batch_compile_s = _decode_batch(
            batch, methods, target_model, draft_model, vocabulary, warmed,
            exclude_compile_time=exclude_compile_time, gamma=rule or gamma, sampling=sampling,
            max_new_tokens=max_new_tokens, seed=seed + batch.examples[0].example.index,
            partitioner=partitioner, tree=tree, speculate=speculate)
        compile_s += batch_compile_s
        out.append(records)
        recorded_this_run += len(records)
        bar.update(batch.num_real, sum(r[methods[-1]]['num_tokens'] for r in records))
    except KeyboardInterrupt:
      bar.close()
      # Counted from the file: Ctrl-C may land after a batch's write, before it was counted.
      recorded = len(outputs_lib.read_predictions(out.predictions_path))
      raise Interrupted(
          f'interrupted after {recorded - num_done} examples ({recorded} of'
          f' {len(examples)} recorded in {job_dir}); rerun the same command to resume.'
      ) from None
    bar.close()

    # 5. The report covers every recorded example, this run's and earlier runs'.
    all_records = outputs_lib.read_predictions(out.predictions_path)
    cost = None
    if rule is not None:
      cost = {'c': rule.draft_cost, 'r': None, 'r_by_gamma': list(rule.verify_costs),
              'max_gamma': rule.max_gamma, 'draft_stopping': rule.draft_stopping,
              'prior_alpha': rule.prior_alpha, 'never_drafts': adaptive.never_drafts(rule),
              'batch_size': batch_size}
    elif measure_cost and draft_model is not None and speculate:
      # A tree's verification costs about a chain's of as many rows (r for its nodes).
      cost = _measure_cost(target_model, draft_model,
                           gamma=gamma if tree is None else tree.num_nodes,
                           batch_size=batch_size,
                           context_length=_cost_context(encoded, max_new_tokens))
    metrics = job_metrics.compute_metrics(all_records, mode=mode, gamma=spec_gamma,
                                          sampling=sampling, cost=cost, tree=tree,
                                          reference_metrics=reference_metrics)
    if policy_record is not None:
      metrics['tree_policy'] = policy_record
      metrics['speculation'] = 'on' if speculate else (
          'off: the tree policy measured the baseline fastest, so the speculative method'
          ' decoded without a draft')
    metrics['job'] = {'wall_time_s': time.perf_counter() - job_start,
                      'compile_and_warmup_s': compile_s, 'batch_size': batch_size,
                      'max_new_tokens': max_new_tokens, 'length_buckets': list(buckets),
                      'input_limit': input_limit,
                      'decoded_this_run': len(pending), 'resumed_from': len(done),
                      'output_dir': job_dir, 'process_index': process_index,
                      'process_count': process_count}
    if partitioner is not None:
      metrics['job']['mesh'] = partitioner.mesh_shape
    outputs_lib.write_json_atomic(out.file(outputs_lib.METRICS), metrics)
    outputs_lib.write_atomic(out.file(outputs_lib.OPERATIVE_CONFIG), gin.operative_config_str())
  except KeyboardInterrupt:
    raise Interrupted(f'interrupted after {recorded_this_run} examples; rerun the same command'
                      ' to resume.') from None
  finally:
    out.close()
  if process_count > 1:
    metrics = _merge_processes(output_dir, process_index, process_count, metrics, mode=mode,
                               gamma=spec_gamma, sampling=sampling, tree=tree,
                               reference_metrics=reference_metrics)
  print(job_metrics.summary(metrics))
  if metrics.get('num_bad_logits'):
    message = (f"{metrics['num_bad_logits']} of {metrics['num_decoded']} examples stopped on"
               ' non-finite (NaN/inf) logits (stop reason BAD_LOGITS; their outputs end before'
               f' it). Check the checkpoints for NaN/Inf; outputs are in {output_dir}.')
    if on_bad_logits == 'fail':
      raise BadLogitsError(message + " Set run_job.on_bad_logits = 'warn' to only warn.")
    warn(message)
  return metrics


def _apply_policy(policy: tree_policy_lib.TreePolicy, out: outputs_lib.OutputDir,
                  batch: inputs_lib.Batch | None, target, draft, *, gamma, sampling, seed,
                  vocabulary, stream) -> tuple[Any, dict[str, Any]]:
  """The tree a `@tree_policy()` job decodes with (None: the chain, or no speculation when the
  entry's 'chosen' is 'baseline') and its metrics entry.

  The choice is made once, on the first pending batch, and recorded in the output directory
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
  if batch is None:
    return None, {'chosen': None, 'note': 'nothing was left to decode, so no calibration ran'}
  rows = min(policy.calibration_rows, batch.num_real)
  trees = sum(tree is not None for tree in policy.candidates.values())
  print(f'Tree policy: timing the baseline, the chain and {trees} tree(s) on {rows} row(s) ×'
        f' {policy.calibration_tokens} tokens ({policy.repeats} timed repeats, each compiled'
        ' first) …', file=stream, flush=True)
  try:
    choice = tree_policy_lib.choose(
        policy, target, draft, batch.tokens[:batch.num_real], batch.lengths[:batch.num_real],
        gamma=gamma, sampling=sampling, eos_id=list(vocabulary.end_ids) or None,
        pad_id=vocabulary.pad_id, seed=seed + batch.examples[0].example.index)
  except ValueError as e:
    raise JobError(f'run_job.tree = @tree_policy(): {e}') from None
  print(f'Tree policy: chose {choice.summary()}.', file=stream, flush=True)
  entry = choice.to_dict()
  outputs_lib.write_json_atomic(recorded, entry)
  return choice.tree, entry


def _cost_context(encoded, max_new_tokens: int) -> int:
  """The context c and r are timed at: the mean input length plus half the new tokens, the
  average position a decode step works at (timing at the smallest length bucket instead
  measured r at 16 positions, where the per-token work outside the products weighs more)."""
  lengths = [e.length for e in encoded if not e.skipped]
  return max(1, int(np.mean(lengths)) if lengths else 1) + max_new_tokens // 2


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


def _report_truncation(encoded, done, input_limit, max_input_length, stream) -> None:
  truncated = sum(1 for e in encoded if e.truncated and e.example.index not in done)
  if truncated:
    why = ('max_input_length' if input_limit == max_input_length else
           'the model context less max_new_tokens')
    print(f'{truncated} input(s) truncated to {input_limit} tokens ({why}).',
          file=stream or sys.stderr)


def _process_dir(process_index: int) -> str:
  return f'process_{process_index:03d}'


def _ensure_sharded(partitioner, model: protocol.Model, role: str) -> protocol.Model:
  """The model with parameters on the partitioner's mesh (providers that took the
  partitioner already placed them; others are sharded here from their host copy)."""
  leaves = jax.tree.leaves(model.params)
  mesh = partitioner.mesh
  if all(isinstance(x, jax.Array) and getattr(x.sharding, 'mesh', None) == mesh
         for x in leaves):
    return model
  return partitioner.shard_model(model, role)


def _merge_processes(output_dir: str, process_index: int, process_count: int,
                     metrics: dict[str, Any], **report_kwargs) -> dict[str, Any]:
  """Process 0 gathers every process's predictions and writes the merged report.

  The records travel over JAX's own collectives (`process_allgather`), not a shared file
  system: on a TPU slice each host writes its part to its own disk (`process_<p>/`), and only
  process 0's `output_dir` gets the merged predictions.jsonl and metrics.json.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  own = os.path.join(output_dir, _process_dir(process_index), outputs_lib.PREDICTIONS)
  with open(own, 'rb') as f:
    data = np.frombuffer(f.read(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64)))
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[:data.size] = data
  parts = np.asarray(multihost_utils.process_allgather(padded))  # [processes, bytes]
  if process_index == 0:
    records, seen = [], set()
    for p in range(process_count):
      text = parts[p, :int(sizes.reshape(-1)[p])].tobytes()
      for line in text.splitlines():
        if not line.strip():
          continue
        record = json.loads(line)
        if record['index'] in seen:
          raise JobError(f'Example {record["index"]} was decoded by two processes; the'
                         f' process directories under {output_dir} belong to different jobs.')
        seen.add(record['index'])
        records.append(record)
    records.sort(key=lambda r: r['index'])
    outputs_lib.write_atomic(os.path.join(output_dir, outputs_lib.PREDICTIONS),
                             ''.join(json.dumps(r, ensure_ascii=False, allow_nan=True) + '\n'
                                     for r in records))
    merged = job_metrics.compute_metrics(records, cost=metrics.get('cost_measurement'), **report_kwargs)
    merged['job'] = dict(metrics['job'], output_dir=output_dir, process_index=0,
                         merged_from=[_process_dir(p) for p in range(process_count)])
    outputs_lib.write_json_atomic(os.path.join(output_dir, outputs_lib.METRICS), merged)
    metrics = merged
  multihost_utils.sync_global_devices('speclm.run: the report is written')
  return metrics


def _base_record(item: inputs_lib.EncodedExample) -> dict[str, Any]:
  example = item.example
  record = {'index': example.index, 'id': example.id, 'input': example.input,
            'input_tokens': item.length, 'truncated': item.truncated}
  if example.reference is not None:
    record['reference'] = example.reference
  if item.skipped:
    record['skipped'] = item.skipped
  return record


def _measure_cost(target, draft, *, gamma, batch_size, context_length) -> dict[str, Any]:
  estimate = measure.measure_costs(target, draft, gamma=gamma, batch_size=batch_size,
                                   context_length=context_length, num_steps=4, repeats=3)
  return estimate.to_dict()


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
