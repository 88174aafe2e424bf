"""One batch of a job: decoded by each method, then turned into predictions.jsonl records.

`decode_batch` runs the job's methods on one `speclm.data.Batch` with the same seed (the
baseline first in compare mode), times each after an untimed first call per batch shape, and
returns one record per real row: the input, and per method its output text, tokens, stop
reason, target calls and time (plus α's β sums, accepted tokens and the γ histogram for the
speculative method).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import numpy as np

from speclm import decoding
from speclm import tree_decoding
from speclm.data import conversations
from speclm.data import inputs as inputs_lib
from speclm.data import vocab as vocab_lib


def decode_one(method: str, target, draft, batch: inputs_lib.Batch, *, gamma, sampling,
               max_new_tokens, seed, eos_id, pad_id, partitioner=None, tree=None,
               speculate=True) -> decoding.DecodeResult:
  """One batch by `method` ('baseline' or 'speculative'), as host arrays.

  Args:
    method: 'baseline' (`autoregressive_decode`) or 'speculative' (`speculative_decode`, or
      `tree_speculative_decode` when `tree` is set).
    target, draft: `speclm.protocol.Model`s (the draft unused by the baseline).
    batch: the batch; `batch.tokens` `[B, P]`, `batch.lengths` `[B]`.
    gamma: γ, or an `adaptive.AdaptiveGamma` rule.
    speculate: False when a tree policy chose the baseline: the 'speculative' method then
      decodes without a draft.
    The rest go to the decode loop as they are.
  """
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


def decode_batch(batch: inputs_lib.Batch, methods: Sequence[str], target, draft,
                 vocabulary: vocab_lib.Vocabulary, warmed: set, *, exclude_compile_time: bool,
                 method_batches: dict[str, inputs_lib.Batch] | None = None,
                 **decode_kwargs) -> tuple[list[dict[str, Any]], float]:
  """Decodes one batch with each method (same seed); returns its records and compile time.

  Args:
    batch: the batch (`[B, P]` tokens); its padding rows are decoded but not recorded.
    methods: the methods in order; each is timed after an untimed first call when
      `exclude_compile_time` and its (method, shape) is not yet in `warmed` (updated here).
    method_batches: a later turn of a conversation (`speclm.run.turns`): each method's own
      batch over the same rows (its conversation holds its own earlier replies); each method's
      entry then records its 'input_tokens'. None: every method decodes `batch`.
    decode_kwargs: `decode_one`'s keyword arguments.
  """
  results, times, compile_s = {}, {}, 0.0
  for method in methods:
    method_batch = batch if method_batches is None else method_batches[method]
    decode = functools.partial(decode_one, method, target, draft, method_batch,
                               eos_id=list(vocabulary.end_ids) or None, pad_id=vocabulary.pad_id,
                               **decode_kwargs)
    key = (method, method_batch.tokens.shape)
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
    record = base_record(item)
    record['batch'] = batch.examples[0].example.index  # rows decoded together share it
    record['batch_rows'] = batch.num_real  # a resume redoes a batch recorded only in part
    for method in methods:
      record[method] = row_record(method, results[method], row, token_lists[method][row],
                                   vocabulary, times[method] / batch.num_real)
      if method_batches is not None:
        record[method]['input_tokens'] = method_batches[method].examples[row].length
    if 'baseline' in methods and 'speculative' in methods:
      record['identical'] = token_lists['baseline'][row] == token_lists['speculative'][row]
    record['output'] = record[methods[-1]]['output']
    records.append(record)
  return records, compile_s


def row_record(method: str, result: decoding.DecodeResult, row: int, tokens: list[int],
               vocabulary: vocab_lib.Vocabulary, time_s: float) -> dict[str, Any]:
  """One method's entry of a row's record: its output and the row's share of the statistics
  (`result` holds `[B]` per-row arrays; `time_s` is the batch's time over its real rows)."""
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


def base_record(item: inputs_lib.EncodedExample) -> dict[str, Any]:
  """The fields every record of an example has: its index, id, input (and reference), input
  length, truncation, a conversation turn's category and turn number, and the reason it was
  skipped if it was."""
  example = item.example
  record = {'index': example.index, 'id': example.id, 'input': example.input,
            'input_tokens': item.length, 'truncated': item.truncated}
  if example.reference is not None:
    record['reference'] = example.reference
  if isinstance(example, conversations.Turn):  # a conversation's turn (plain datasets: none)
    record['category'] = example.category
    record['turn'] = example.turn
  if item.skipped:
    record['skipped'] = item.skipped
  return record
