"""Where a decode loop's time goes, by part of the program: a profiler trace's operations
grouped by the op names XLA's HLO gives them.

`scripts/profile_decode.py --by_part` dumps the compiled HLO (`XLA_FLAGS=--xla_dump_to=DIR`),
traces a decode, and sums the trace's operations with `part_times`. Only the operations inside
the decode loop's `while` body count (the rounds or steps, not the prompt's prefill). A part is
the first `depth` levels of an operation's op name below the loop, with `layers_<i>` merged
into `layers_*`: `LlamaModule/layers_*/mlp` (the target's MLPs), `LlamaModule.logits/lm_head`
(its head), `EagleModule/head` (an EAGLE draft's), and `(loop) reduce_max` for an operation of
the loop itself (acceptance, sampling, bookkeeping).

    names = profile_parts.op_names(hlo_dir)
    total_us, counts = profile_parts.part_times(trace_events, names, depth=3)
"""

from __future__ import annotations

import collections
import glob
import os
import re

# Operations XLA left without an op name (some wrapped reductions) in a decode loop's program:
# they may be in the loop's body or in its prefill.
UNNAMED = '(no op name, loop or prefill)'

_LOOP_BODY = re.compile(r'jit\(_\w*loop\)/while/body/')
_LOOP_MODULE = re.compile(r'jit__\w*loop$')
_WRAPPERS = ('while', 'body', 'cond', 'closed_call', '')


def op_names(hlo_dir: str) -> dict[tuple[str, str], str]:
  """(module, instruction) -> its op name, from the `*after_optimizations.txt` files of an HLO
  dump (module: the file's program name, e.g. `jit__speculative_loop`)."""
  names = {}
  for path in glob.glob(os.path.join(hlo_dir, '*after_optimizations.txt')):
    module = re.sub(r'^module_\d+\.', '', os.path.basename(path)).split('.')[0]
    with open(path, encoding='utf-8') as f:
      for line in f:
        found = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]+)"', line)
        if found:
          names[(module, found.group(1))] = found.group(2)
  return names


def part_of(op_name: str, depth: int) -> str | None:
  """The part an operation of op name `op_name` belongs to, or None outside a decode loop's
  `while` body (see the module docstring)."""
  if not _LOOP_BODY.match(op_name):
    return None
  levels = [re.sub(r'^layers_\d+$', 'layers_*', level)
            for level in re.sub(r'jit\([^)]*\)/?', '', op_name).split('/')
            if level not in _WRAPPERS]
  if not levels or not levels[0][:1].isupper():  # not inside a model's module
    return '(loop) ' + (levels[0] if levels else 'while')
  return '/'.join(levels[:depth])


def part_times(events, names: dict[tuple[str, str], str],
               depth: int) -> tuple[collections.Counter, collections.Counter]:
  """Microseconds and counts per part (`part_of`) over trace events (the trace viewer's
  `traceEvents`: complete events whose `args` name their `hlo_module` and `hlo_op`). An
  event counts its own time only, not that of the events nested in it (`_own_times`)."""
  total, count = collections.Counter(), collections.Counter()
  events = [event for event in events
            if event.get('ph') == 'X' and 'hlo_op' in event.get('args', {})]
  own = _own_times(events)
  for event, micros in zip(events, own):
    args = event['args']
    module = args.get('hlo_module', '')
    name = names.get((module, args['hlo_op']))
    part = UNNAMED if name is None and _LOOP_MODULE.match(module) else (
        None if name is None else part_of(name, depth))
    if part is not None:
      total[part] += micros
      count[part] += 1
  return total, count


def _own_times(events) -> list[float]:
  """Each event's own microseconds: its duration less those of the events nested directly in
  it on the same thread. A `while` (or `conditional`) operation's event spans its body's
  operations, which have events of their own: counted whole, a draft's γ-step loop inside a
  round would appear twice, once as its parts and once as '(loop) while'. Events without a
  start time count whole."""
  own = [float(event.get('dur', 0)) for event in events]
  threads = collections.defaultdict(list)
  for i, event in enumerate(events):
    if 'ts' in event:
      threads[(event.get('pid'), event.get('tid'))].append(i)
  for indices in threads.values():
    indices.sort(key=lambda i: (events[i]['ts'], -events[i].get('dur', 0)))
    open_events = []  # indices of the events that enclose the current one, outermost first
    for i in indices:
      start = events[i]['ts']
      end = start + events[i].get('dur', 0)
      while open_events and _end(events[open_events[-1]]) <= start:
        open_events.pop()
      if open_events and end <= _end(events[open_events[-1]]):
        own[open_events[-1]] -= events[i].get('dur', 0)
      open_events.append(i)
  return own


def _end(event) -> float:
  return event['ts'] + event.get('dur', 0)
