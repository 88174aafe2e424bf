"""Spec-Bench's workload of scripts/benchmark.py: every method side by side, turn by turn.

Spec-Bench (Xia et al., 2024) reports each method's speedup over the baseline and τ (mean
tokens per target call) per task: MT-bench (two turns), translation, summarization, QA, math
reasoning and RAG. Here each question file row becomes one example per turn
(`speclm.data.conversations`, MT-bench's eight categories as the one task 'mt_bench'). Every
turn is decoded by every method in turn (the order rotated from turn to turn, so slow drift of a
noisy machine hits all methods alike), batch 1; a later turn is asked after the method's own
reply to the earlier one, the conversation rendered with the chat template
(`speclm.run.turns.conversation`, `Vocabulary.encode_conversation`). At temperature 0 exact
methods reply as the baseline does, so they decode the same inputs.

Each (method, input width) is decoded once untimed before its first timed decode (compilation).
The per-category table reuses the job's arithmetic (`speclm.analysis.category_report`): speedup
= baseline time / method time, τ, α, tokens/s; the overall row as Spec-Bench computes it, total
tokens over total time. This module holds no flags: scripts/benchmark.py passes its settings.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from typing import Any, Callable, Sequence

import numpy as np

import speclm
from speclm import token_trees
from speclm.analysis import benchmarking
from speclm.analysis import category_report
from speclm.data import conversations
from speclm.data import vocab as vocab_lib
from speclm.run import turns as turns_lib

HEADING = '## Spec-Bench'
BASELINE = 'baseline'
# CPU features that decide how fast the products run (shown in the section's header).
RELEVANT_CPU_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'avx512_vnni', 'amx_bf16',
                      'amx_tile', 'neon', 'asimd', 'sve')


@dataclasses.dataclass(frozen=True)
class Method:
  """One decoding method of the side-by-side run.

  Attributes:
    name: its row label.
    decode: (prompt `[1, P]` int32, lengths `[1]`, temperature, seed) -> (generated tokens
      `[N]` numpy, the run's `DecodeStats` or None when it has none, e.g. Hugging Face's).
    exact: whether its greedy output must equal the baseline's (speclm's own loops).
  """

  name: str
  decode: Callable[[np.ndarray, np.ndarray, float, int], tuple[np.ndarray, Any]]
  exact: bool = True


# The best static tree of scripts/estimate_tree_drafts.py (docs/drafts.md), as
# scripts/benchmark_trees.py names it.
BEST_STATIC_TREE = ('paths5', token_trees.TreeShape.from_paths(
    [(0,), (1,), (2,), (0, 0), (0, 0, 0)]))


def speclm_method(name: str, decode, *, max_new_tokens: int, exact: bool = True) -> Method:
  """A `Method` of one of speclm's decode functions (`decode(tokens, lengths, **settings)`,
  e.g. `speculative_decode` with its models bound), making `max_new_tokens` tokens."""
  def run(tokens, lengths, temperature, seed):
    result = decode(tokens, lengths, sampling=speclm.SamplingConfig(temperature=temperature),
                    max_new_tokens=max_new_tokens, eos_id=None, seed=seed)
    return np.asarray(result.tokens)[0], result.stats
  return Method(name, run, exact)


def hf_assisted_method(plain_target, plain_draft, *, pad_id: int, max_new_tokens: int,
                       gamma: int, threads: int) -> Method:
  """Hugging Face's assisted generation (`plain_draft` alone as the assistant, `gamma` constant
  assistant tokens), PyTorch on `threads` CPU threads, the same float32 weights; not exact
  against ours (PyTorch sums in another order)."""
  import torch  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(threads)
  hf_target = hf_llama.to_transformers(plain_target)
  hf_draft = hf_llama.subset_draft_to_transformers(plain_draft)

  def run(tokens, lengths, temperature, seed):
    ids = torch.tensor(tokens[:, :int(lengths[0])], dtype=torch.long)
    config = benchmarking.hf_generation_config(
        temperature=temperature, assisted=True, new_tokens=max_new_tokens, gamma=gamma,
        pad_id=pad_id)
    torch.manual_seed(seed)
    with torch.no_grad():
      out = hf_target.generate(ids, attention_mask=torch.ones_like(ids),
                               generation_config=config, assistant_model=hf_draft)
    return out[0, ids.shape[1]:].numpy(), None
  return Method('HF assisted generation', run, exact=False)


def chat_vocabulary(tok) -> vocab_lib.Vocabulary:
  """A `speclm.tokenizer.Tokenizer` with a chat template as a vocabulary whose
  `encode_conversation` renders a whole conversation with that template."""
  return vocab_lib.FunctionVocabulary(tok.encode_chat, tok.decode, tok.vocab_size,
                                      eos_id=tok.eos_id, pad_id=tok.pad_id or 0,
                                      end_ids=tok.end_ids, conversation_fn=tok.encode_chat)


def read_turns(path: str, per_category: int) -> list[conversations.Turn]:
  """The turns of the first `per_category` conversations of each Spec-Bench task.

  Raises:
    conversations.DataError: the file is missing or a row is bad (file:line in the message).
  """
  return conversations.read_conversations(path, per_category=per_category,
                                          category_map=conversations.SPEC_BENCH_TASKS)


def _padded(ids: Sequence[int], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """`ids` right-padded to a multiple of 128 (`benchmarking.padded_width`): `[1, P]`, `[1]`."""
  tokens = np.full((1, benchmarking.padded_width(len(ids))), pad_id, np.int32)
  tokens[0, :len(ids)] = ids
  return tokens, np.array([len(ids)], np.int32)


def turn_record(tokens: np.ndarray, stats: Any, seconds: float, text: str) -> dict[str, Any]:
  """One decoded turn's record for `category_report` (with the tokens and the reply text).

  Args:
    tokens: `[N]` the generated tokens.
    stats: the decode's `DecodeStats` (target calls, β sum and count), or None (Hugging
      Face's: τ and α are then n/a).
    seconds: the timed decode's wall time; text: the reply, cut at the end token.
  """
  return dict(tokens=tokens, output=text, time_s=seconds, num_tokens=int(np.size(tokens)),
              target_calls=0 if stats is None else int(stats.target_calls),
              beta_sum=0.0 if stats is None else float(stats.beta_sum),
              beta_count=0 if stats is None else int(stats.beta_count))


def run_turns(methods: Sequence[Method], turns: Sequence[conversations.Turn],
              vocabulary: vocab_lib.Vocabulary, temperature: float,
              progress: Callable[[str], Any] = print) -> dict[str, dict[int, dict[str, Any]]]:
  """Decodes every turn with every method at `temperature`; turn k uses seed k.

  Args:
    methods: the methods, the baseline named `BASELINE`; turn k starts with method k mod M.
    turns: the turns in file order (a conversation's earlier turns before its later ones).
    vocabulary: renders each method's conversation so far (`encode_conversation`) and
      decodes its replies.
    progress: called with one line per turn.

  Returns:
    method name -> turn index -> its record (`turn_record`).
  """
  by_index = {turn.index: turn for turn in turns}
  records: dict[str, dict[int, dict[str, Any]]] = {m.name: {} for m in methods}
  compiled: set[tuple[str, int]] = set()
  for k, turn in enumerate(turns):
    for method in methods[k % len(methods):] + methods[:k % len(methods)]:
      recorded = {i: {method.name: r} for i, r in records[method.name].items()}
      messages = turns_lib.conversation(turn, by_index, recorded, method.name)
      tokens, lengths = _padded(vocabulary.encode_conversation(messages), vocabulary.pad_id)
      if (method.name, tokens.shape[1]) not in compiled:  # compile (and warm) untimed
        method.decode(tokens, lengths, temperature, turn.index)
        compiled.add((method.name, tokens.shape[1]))
      started = time.perf_counter()
      out, stats = method.decode(tokens, lengths, temperature, turn.index)
      seconds = time.perf_counter() - started
      records[method.name][turn.index] = turn_record(out, stats, seconds, vocabulary.decode(out))
    progress(f'T={temperature:g} turn {k + 1}/{len(turns)} ({turn.category}, turn'
             f' {turn.turn}): ' + ', '.join(
                 f'{m.name} {records[m.name][turn.index]["time_s"]:.2f} s' for m in methods))
  return records


def category_tables(records: dict[str, dict[int, dict[str, Any]]],
                    turns: Sequence[conversations.Turn]) -> dict[str, dict[str, Any]]:
  """method -> its `category_report.by_category` table against the baseline (categories in
  the order first seen, then 'overall')."""
  tables = {}
  for name, by_turn in records.items():
    decoded = [dict(id=turn.id, category=turn.category, baseline=records[BASELINE][turn.index],
                    speculative=by_turn[turn.index]) for turn in turns]
    tables[name] = category_report.by_category(decoded, ('baseline', 'speculative'))
  return tables


def exactness_checks(methods: Sequence[Method],
                     records: dict[str, dict[int, dict[str, Any]]]) -> dict[str, bool]:
  """'greedy <method> = baseline' -> whether every turn's tokens equal the baseline's."""
  base = records[BASELINE]
  return {f'greedy {m.name} = baseline': all(
              np.array_equal(entry['tokens'], base[i]['tokens'])
              for i, entry in records[m.name].items())
          for m in methods if m.exact and m.name != BASELINE}


def table_lines(tables: dict[str, dict[str, Any]]) -> list[str]:
  """The markdown table: a row per (category, method), the overall rows last."""
  lines = ['| category | method | turns | speedup | τ (tokens / target call) | α |'
           ' tokens / s |', '| --- | --- | --- | --- | --- | --- | --- |']
  categories = list(next(iter(tables.values())))
  for category in categories:
    for name, table in tables.items():
      row = table[category]
      label = f'**{category}**' if category == category_report.OVERALL else category
      lines.append(f'| {label} | {name} | {row["turns"]} |'
                   f' {benchmarking.fmt(row.get("speedup"))}× |'
                   f' {benchmarking.fmt(row.get("tokens_per_target_call"))} |'
                   f' {benchmarking.fmt(row.get("alpha"), ".3f")} |'
                   f' {benchmarking.fmt(row.get("speculative_tokens_per_s"), ".1f")} |')
  return lines


def cpu_line() -> str:
  """The CPU's model name (lscpu's, else /proc/cpuinfo's) and which of
  `RELEVANT_CPU_FLAGS` it has."""
  name, flags = None, set()
  if shutil.which('lscpu'):
    try:
      text = subprocess.run(['lscpu'], capture_output=True, text=True, check=False,
                            timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
      text = ''
    for line in text.splitlines():
      key, _, value = line.partition(':')
      if key.strip() == 'Model name' and name is None:
        name = value.strip()
      elif key.strip() == 'Flags':
        flags = set(value.split())
  if not flags and os.path.isfile('/proc/cpuinfo'):
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      flags = set(next((l.split(':', 1)[1] for l in f if re.match(r'(flags|Features)\s*:', l)),
                       '').split())
  shown = [flag for flag in RELEVANT_CPU_FLAGS if flag in flags]
  return (f'{name or benchmarking.cpu_name()}, {os.cpu_count()} CPU cores visible; flags:'
          f' {" ".join(shown) or "none of " + " ".join(RELEVANT_CPU_FLAGS)}')


def section(results: dict[float, dict[str, Any]], *, command: str, settings: str,
            seconds: float) -> str:
  """The report's Spec-Bench section (markdown, from `HEADING` on).

  Args:
    results: temperature -> {'tables': `category_tables`, 'checks': `exactness_checks`}.
    command: the exact command that wrote it; settings: one line of the run's settings.
  """
  lines = [HEADING, '', f'Written by `{command}` (do not edit by hand; rerun it);'
           f' run time {seconds / 60:.1f} min.', '', f'- machine: {cpu_line()}',
           f'- {settings}',
           '- speedup: baseline time / method time; τ: tokens per target call (the prefill'
           ' counted); α: Σβ / count; tokens / s: the method\'s. The **overall** rows are'
           ' Spec-Bench\'s: total tokens over total time, method / baseline.', '']
  for temperature, result in results.items():
    lines += [f'### Temperature {temperature:g}', ''] + table_lines(result['tables']) + ['']
    lines += benchmarking.check_lines(result['checks']) + [''] if result['checks'] else []
  return '\n'.join(lines)


def write_section(text: str, path: str, title: str = '# Benchmarks') -> None:
  """Writes `text` (a section starting with `HEADING`) into the report at `path`: replacing
  its Spec-Bench section if it has one (up to the next level-2 heading), else appended; a
  missing report gets `title` first."""
  old = ''
  if os.path.isfile(path):
    with open(path, encoding='utf-8') as f:
      old = f.read()
  before, _, after = split_section(old)
  if not before.strip():
    before = title + '\n\n'
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(before.rstrip('\n') + '\n\n' + text.rstrip('\n') + '\n'
            + (('\n' + after) if after else ''))
  print(f'wrote the Spec-Bench section into {path}', flush=True)


def split_section(report: str) -> tuple[str, str, str]:
  """(text before the Spec-Bench section, the section, text after it) of a report; the
  section is empty when the report has none."""
  match = re.search(rf'^{re.escape(HEADING)}\s*$', report, flags=re.MULTILINE)
  if match is None:
    return report, '', ''
  rest = report[match.start():]
  end = re.search(r'^## ', rest[len(HEADING):], flags=re.MULTILINE)
  stop = len(rest) if end is None else len(HEADING) + end.start()
  return report[:match.start()], rest[:stop], rest[stop:]
