"""The side-by-side timing harness shared by `scripts/benchmark.py` and `scripts/benchmark_t5.py`.

`interleaved_rounds` is speclm's one timing loop: it runs several callables once per round, in
turn, so that slow periods of a shared machine hit them all alike. The calibration's
`time_extend`, `measure_costs` and `measure_speedup` (`speclm.run.calibration`) take medians
of its rounds.

A benchmark is a list of `Case`s, each a callable that generates a fixed number of tokens per
row. `warm_up` compiles and warms every case up; `run_rounds` then runs them all once per
round, in turn, probing the memory bandwidth at the start of each round, and ratios are taken
round by round (`ratio`) before the median, so they stay meaningful when absolute times drift.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing timed each round. `run(round)` -> generated tokens `[B, N]` (numpy).

  Attributes:
    name, group: how reports find and list it ('main', 'hf', 'ablation', …).
    batch_size, temperature: its setting.
    new_tokens: N, tokens each row generates per call (for per-token times).
    run: generates; the round index picks the prompt and the seed.
    trace_context: a context manager factory under which the case is compiled (its first
      run), e.g. a benchmark's "before" code for ablations; None: the code as it is.
    seconds, outputs, stats: filled round by round (`stats` by `run` itself, if it has any).
  """

  name: str
  group: str
  batch_size: int
  temperature: float
  new_tokens: int
  run: Callable[[int], np.ndarray]
  trace_context: Callable[[], Any] | None = None
  seconds: list[float] = dataclasses.field(default_factory=list)
  outputs: list[np.ndarray] = dataclasses.field(default_factory=list)
  stats: list[Any] = dataclasses.field(default_factory=list)

  def ms_per_token(self) -> list[float]:
    """Per round: milliseconds per generated position (one step of every row)."""
    return [1e3 * s / self.new_tokens for s in self.seconds]

  def tokens_per_second(self) -> list[float]:
    """Per round: tokens generated per second over all rows."""
    return [self.batch_size * self.new_tokens / s for s in self.seconds]

  def pooled_alpha(self) -> float:
    """α over every round of a speculative case: the exact β sum over the β count."""
    count = sum(int(s.beta_count) for s in self.stats)
    return sum(float(s.beta_sum) for s in self.stats) / max(count, 1)

  def tokens_per_target_call(self) -> float:
    """Generated positions per target call over every round of a speculative case."""
    calls = sum(int(s.target_calls) for s in self.stats)
    return self.new_tokens * len(self.stats) / max(calls, 1)


def find(cases: Sequence[Case], name: str, batch_size: int, temperature: float,
         group: str | None = None) -> Case | None:
  """The first case with this name and setting (and group, if given), or None."""
  for case in cases:
    if (case.name == name and case.batch_size == batch_size and case.temperature == temperature
        and (group is None or case.group == group)):
      return case
  return None


def median(xs: Sequence[float]) -> float:
  """The median of `xs` (`statistics.median`)."""
  return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
  """'min–max' with one decimal."""
  return f'{min(xs):.1f}–{max(xs):.1f}'


def ratio(numerator: Case | None, denominator: Case | None) -> float | None:
  """Speedup of `numerator` over `denominator`: the median of per-round time ratios."""
  if numerator is None or denominator is None:
    return None
  return median([d / n for n, d in zip(numerator.seconds, denominator.seconds)])


def outputs_equal(a: Case, b: Case) -> bool:
  """Whether two cases generated the same tokens in every round."""
  return len(a.outputs) == len(b.outputs) and all(
      np.array_equal(x, y) for x, y in zip(a.outputs, b.outputs))


def memory_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
  """Bytes per second one jitted reduction streams from memory here (median of repeats).

  Benchmarks probe it once per round, between the cases, because on a shared machine the
  figure moves from run to run as much as the timings do.
  """
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    total(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return num_bytes / statistics.median(times)


def warm_up(cases: Sequence[Case]) -> None:
  """Compiles and runs every case once (round 0), then forgets what that run recorded."""
  for case in cases:
    start = time.time()
    if case.trace_context is not None:
      with case.trace_context():
        case.run(0)
    else:
      case.run(0)
    case.stats.clear()
    print(f'  {case.name} (batch {case.batch_size}, T={case.temperature:g}):'
          f' {time.time() - start:.1f}s', flush=True)


def interleaved_rounds(
    runs: Sequence[Callable[[int], Any]], rounds: int, *,
    before_round: Callable[[int], Any] | None = None,
    after_round: Callable[[int, list[float], list[Any]], Any] | None = None,
) -> list[list[float]]:
  """Runs every callable once per round, in turn; returns each one's seconds, round by round.

  Interleaving spreads slow periods of a shared machine over all the callables alike, so their
  ratios stay meaningful even when absolute times drift. `run(round_index)` is timed until its
  result is ready (`jax.block_until_ready`). `before_round(round_index)` runs, untimed, before
  a round's first call; `after_round(round_index, seconds, outputs)` after its last, with each
  call's seconds and result in that round.

  Returns:
    `seconds[i][k]`: the time of `runs[i]` in round k.
  """
  seconds = [[] for _ in runs]
  for round_index in range(rounds):
    if before_round is not None:
      before_round(round_index)
    outputs = []
    for run, samples in zip(runs, seconds):
      start = time.perf_counter()
      out = jax.block_until_ready(run(round_index))
      samples.append(time.perf_counter() - start)
      outputs.append(out)
    if after_round is not None:
      after_round(round_index, [samples[-1] for samples in seconds], outputs)
  return seconds


def run_rounds(cases: Sequence[Case], rounds: int, *, shown: int = 8) -> list[float]:
  """Runs every case once per round, in turn (`interleaved_rounds`), recording each case's
  seconds and outputs; returns the memory bandwidth probed before each round.

  After each round it prints the first `shown` cases' milliseconds per token.
  """
  bandwidths = []

  def record(round_index: int, seconds: list[float], outputs: list[Any]) -> None:
    for case, case_seconds, out in zip(cases, seconds, outputs):
      case.seconds.append(case_seconds)
      case.outputs.append(out)
    print(f'round {round_index + 1}/{rounds}: ' + ', '.join(
        f'{c.name[:22]} b{c.batch_size} T{c.temperature:g} {c.ms_per_token()[-1]:.0f}'
        for c in cases[:shown]) + ' ms/token', flush=True)

  interleaved_rounds([case.run for case in cases], rounds,
                     before_round=lambda _: bandwidths.append(memory_bandwidth()),
                     after_round=record)
  return bandwidths


def padded_width(length: int, multiple: int = 128) -> int:
  """Prompts are padded to a multiple of 128 tokens (one compiled shape per multiple)."""
  return multiple * -(-length // multiple)


def chat_prompt_batch(tok, prompts: Sequence[str], width: int | None = None):
  """Chat-encoded prompts (`speclm.tokenizer`'s `encode_chat`) right-padded to `width`
  (default: `padded_width` of the longest): (tokens `[B, width]`, lengths `[B]`)."""
  rows = [tok.encode_chat(p) for p in prompts]
  width = width or padded_width(max(len(r) for r in rows))
  tokens = np.full((len(rows), width), tok.pad_id or 0, np.int32)
  for b, row in enumerate(rows):
    tokens[b, :len(row)] = row
  return tokens, np.array([len(r) for r in rows], np.int32)


def versions(names: Sequence[str] = ('jax', 'jaxlib', 'flax', 'numpy', 'torch',
                                     'transformers')) -> str:
  """'name version, …' of the installed packages among `names`."""
  out = []
  for name in names:
    try:
      out.append(f'{name} {importlib.metadata.version(name)}')
    except importlib.metadata.PackageNotFoundError:
      pass
  return ', '.join(out)


def cpu_name() -> str:
  """The CPU's model name (from /proc/cpuinfo where there is one)."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def machine_line() -> str:
  """One report line: CPU, cores, Python and package versions."""
  return (f'{cpu_name()}, {os.cpu_count()} CPU cores visible, Python'
          f' {platform.python_version()}, {versions()}')


def hf_generation_config(*, temperature: float, assisted: bool, new_tokens: int, gamma: int,
                         pad_id: int):
  """A `transformers.GenerationConfig` making exactly `new_tokens` tokens (no end token).

  Sampling is plain temperature sampling (no top-k/top-p); assisted generation proposes a
  constant `gamma` assistant tokens per round, as speclm's loop does.
  """
  import transformers  # pylint: disable=import-outside-toplevel
  settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                  pad_token_id=pad_id)
  if temperature > 0:
    settings.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
  else:
    settings.update(do_sample=False)
  if assisted:
    settings.update(num_assistant_tokens=gamma, num_assistant_tokens_schedule='constant',
                    assistant_confidence_threshold=0.0)
  return transformers.GenerationConfig(**settings)


# ----------------------------------------------------------------------------------------------
# Report sections shared by the benchmarks (markdown lines)


def time_table(cases: Sequence[Case]) -> list[str]:
  """'## Time per generated token': each case's median, spread and throughput."""
  lines = ['## Time per generated token', '',
           '| case | batch | T | median ms / token (per row-step) | spread |'
           ' tokens / s (all rows) |', '| --- | --- | --- | --- | --- | --- |']
  for case in cases:
    lines.append(f'| {case.name} | {case.batch_size} | {case.temperature:g} |'
                 f' {median(case.ms_per_token()):.1f} | {spread(case.ms_per_token())} |'
                 f' {median(case.tokens_per_second()):.1f} |')
  return lines


def floor_ratio(base_ms: Sequence[float], floor_ms: Sequence[float]) -> float:
  """The median over rounds of (baseline time per token / that round's floor)."""
  return median([t / f for t, f in zip(base_ms, floor_ms)])


def floor_section(bandwidths: Sequence[float], floor_ms: Sequence[float],
                  base_ms: Sequence[float], bytes_line: str) -> list[str]:
  """'## Memory-bandwidth floor': the probed bandwidth, the bytes per step (`bytes_line`),
  the floor per round against our batch-1 baseline."""
  return [
      '## Memory-bandwidth floor',
      '',
      f'- bandwidth, measured at the start of every round (one jitted sum over 1 GiB): median'
      f' {median(bandwidths) / 1e9:.1f} GB/s, spread'
      f' {spread([b / 1e9 for b in bandwidths])} GB/s',
      f'- {bytes_line}',
      f'- floor: {median(floor_ms):.1f} ms per token (median over rounds); our baseline:'
      f' {median(base_ms):.1f} ms; median of the per-round ratios:'
      f' {floor_ratio(base_ms, floor_ms):.2f}× the floor',
  ]


def fmt(x: float | None, spec: str = '.2f') -> str:
  """A number for a report table; '—' for a missing one."""
  return '—' if x is None else format(x, spec)


def report_header(title: str, script: str, seconds: float,
                  flags: Sequence[str] | None = None) -> list[str]:
  """The title, the "written by" line (the script with the flags it was given: `flags`, or
  this process's command-line arguments), the date and run time, and the machine."""
  flags = sys.argv[1:] if flags is None else flags
  command = shlex.join(['python', script, *flags])
  return [f'# {title}', '',
          f'Written by `{command}` (do not edit by hand; rerun it).', '',
          f'- date: {datetime.date.today().isoformat()}; total run time {seconds / 60:.1f} min',
          f'- machine: {machine_line()}']


def write_report(report: str, path: str) -> None:
  """Prints the report and writes it to `path` (creating its folder)."""
  print(report)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(report)
  print(f'wrote {path}')


def check_lines(checks: dict[str, bool]) -> list[str]:
  """'- name: yes' per check ('NO' when it failed)."""
  return [f'- {name}: {"yes" if ok else "NO"}' for name, ok in checks.items()]
