r"""Where a decode loop spends its time: a JAX profiler trace, summed per XLA operation.

Decodes the demo prompts with SmolLM2-135M (baseline or speculative with a shipped draft)
once to compile, once under `jax.profiler.trace`, then prints the operations that took the
most time per target call, e.g. the matrix products ("dot", "ynn_fusion"), copies XLA
inserted for layouts ("copy_bitcast_fusion"), reductions ("iota_reduce_fusion" is an argmax).
Map a name to its HLO with `XLA_FLAGS=--xla_dump_to=DIR` (the `*after_optimizations.txt`).

With `--by_part` it also sums the operations inside the decode loop's `while` body (the rounds
or steps, not the prefill) by the part of the program they come from, read from the HLO's
op names (`speclm.analysis.profile_parts`): the target's layers' attention and MLPs, its head,
the draft's parts, and the loop's own operations. It dumps the compiled HLO to a temporary
directory to map the trace's operations to those names.

  pip install -e '.[profile]'
  python scripts/profile_decode.py --mode=speculative --max_new_tokens=64
  python scripts/profile_decode.py --mode=tree --tree_paths='0 1 0.0' --lookup_min_ngram=2
  python scripts/profile_decode.py --mode=tree --dynamic_tree=8,4,3,2 --lookup_min_ngram=2
  python scripts/profile_decode.py --mode=baseline --quantized --max_new_tokens=128
  python scripts/profile_decode.py --mode=speculative --gamma=3 --by_part  # target, draft, loop
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import tempfile
import time

import jax
from absl import app
from absl import flags

import speclm
from speclm import adaptive
from speclm import token_trees
from speclm.analysis import profile_parts
from speclm.data import builtin_prompts
from speclm.models import llama
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.run import calibration

_MODE = flags.DEFINE_enum('mode', 'speculative', ['baseline', 'speculative', 'adaptive', 'tree'],
                          'Loop profiled (adaptive: speculative_decode with an AdaptiveGamma'
                          ' rule of γ_max --gamma; tree: tree_speculative_decode with'
                          ' --tree_paths).')
_TREE_PATHS = flags.DEFINE_string('tree_paths', '0 1 0.0',
                                  'The static tree of --mode=tree, as rank paths (Medusa style:'
                                  ' "0 1 0.0" is two children of the root, one grandchild).')
_DYNAMIC_TREE = flags.DEFINE_string(
    'dynamic_tree', None, 'With --mode=tree: an EAGLE-2 DynamicTree "num_nodes,depth,top_k,width"'
    ' (e.g. "8,4,3,2") instead of --tree_paths.')
_DRAFT = flags.DEFINE_enum('draft', 'eagle', ['eagle', 'two_layer'],
                           'The shipped draft profiled: the EAGLE-3 draft (the demo\'s) or the'
                           ' token-only 2-layer draft.')
_LOOKUP = flags.DEFINE_integer('lookup_min_ngram', 0, 'Prompt lookup before the draft, as the'
                               ' demo runs it (0: the draft alone).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens generated.')
_MIN_PROMPT = flags.DEFINE_integer(
    'min_prompt_tokens', 0, 'Each demo prompt repeated (one copy a line) until its chat'
    ' encoding has at least this many tokens: a decode at a long context, as Spec-Bench\'s'
    ' summarization and retrieval prompts make.')
_BATCH = flags.DEFINE_integer('batch_size', 1, 'Demo prompts decoded together.')
_GAMMA = flags.DEFINE_integer('gamma', 4, 'γ for speculative decoding.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0, 'Sampling temperature.')
_FORCE_GAMMA = flags.DEFINE_integer(
    'force_gamma', None, 'With --mode=adaptive: costs that make the rule choose this γ in every'
    ' round (0: the draft sits rounds out, as a batch that stopped speculating does), instead'
    ' of c and r(γ) measured for the batch size (cached per machine).')
_TOP = flags.DEFINE_integer('top', 20, 'Operations listed.')
_TRACE_DIR = flags.DEFINE_string('trace_dir', None, 'Keep the trace here (default: temporary).')
_CPU_KERNELS = flags.DEFINE_bool('cpu_kernels', True, 'Products through the packed CPU kernel'
                                 ' (llama.pack_for_cpu), as the demo and the benchmark run.')
_BY_PART = flags.DEFINE_bool('by_part', False, 'Also sum the decode loop\'s operations by the'
                             ' part of the program they come from (see the module docstring).')
_PART_DEPTH = flags.DEFINE_integer('part_depth', 3, 'With --by_part: how many levels of the op'
                                   ' name make a part (2: `LlamaModule/layers_*`; 3 adds'
                                   ' `attention` or `mlp`).')
_QUANTIZED = flags.DEFINE_bool('quantized', False, 'The target\'s matrices kept in the GGUF'
                               ' file\'s blocks (`smollm2_model.quantized`, as'
                               ' scripts/benchmark_quantized.py runs it) instead of float32.')


def trace_events(trace_dir: str) -> list[dict]:
  """The trace viewer's events of the trace written under `trace_dir`."""
  from xprof.convert import raw_to_tool_data  # pylint: disable=import-outside-toplevel
  files = glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True)
  if not files:
    raise FileNotFoundError(f'No trace written under {trace_dir}.')
  data, _ = raw_to_tool_data.xspace_to_tool_data(files, 'trace_viewer', {})
  return json.loads(data if isinstance(data, str) else data.decode())['traceEvents']


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
  """Total microseconds and counts per operation name (numeric suffixes merged)."""
  events = trace_events(trace_dir)
  total, count = collections.Counter(), collections.Counter()
  for event in events:
    name = event.get('name', '')
    # Runtime bookkeeping (thread pools, executors) and Python frames ('$…') are not ops.
    if event.get('ph') != 'X' or name.startswith(('Thunk', 'Threadpool', 'Slinky', '$', 'end:')):
      continue
    name = re.sub(r'\.\d+$', '', name)
    total[name] += event.get('dur', 0)
    count[name] += 1
  return total, count


def _lengthened(prompt: str, tok, min_tokens: int) -> str:
  """`prompt` repeated, one copy a line, until its chat encoding has `min_tokens` tokens."""
  text = prompt
  while len(tok.encode_chat(text)) < min_tokens:
    text += '\n' + prompt
  return text


def _tree() -> speclm.TreeShape | token_trees.DynamicTree:
  """--mode=tree's tree: --dynamic_tree if given, else --tree_paths."""
  if _DYNAMIC_TREE.value:
    return token_trees.DynamicTree(*(int(x) for x in _DYNAMIC_TREE.value.split(',')))
  paths = [tuple(int(r) for r in path.split('.')) for path in _TREE_PATHS.value.split()]
  return speclm.TreeShape.from_paths(paths)


def main(argv):
  del argv
  hlo_dir = None
  if _BY_PART.value:  # before the first computation creates the backend, which reads the flags
    hlo_dir = tempfile.mkdtemp(prefix='speclm_hlo_')
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} --xla_dump_to={hlo_dir}'
  target, tok = smollm2.load_model(quantized=_QUANTIZED.value), smollm2.load_tokenizer()
  draft = None
  if _MODE.value != 'baseline':
    load = smollm2_draft.load_eagle if _DRAFT.value == 'eagle' else smollm2_draft.load
    draft = load(target, cpu_kernels=_CPU_KERNELS.value)
    if _LOOKUP.value:
      draft = lookup.lookup_first(draft, min_ngram=_LOOKUP.value)
  if _CPU_KERNELS.value:
    target = llama.pack_for_cpu(target)
  prompts = [_lengthened(p, tok, _MIN_PROMPT.value)
             for p in (builtin_prompts.demo_prompts() * _BATCH.value)[:_BATCH.value]]
  tokens, lengths = tok.batch([tok.encode_chat(p) for p in prompts])
  sampling = speclm.SamplingConfig(temperature=_TEMPERATURE.value)

  def adaptive_rule():
    if _FORCE_GAMMA.value is None:
      return calibration.measure_adaptive_gamma(target, draft, max_gamma=_GAMMA.value,
                                                batch_size=_BATCH.value)
    # r(γ) rising steeply past the forced γ, and falling to it, make it the best choice.
    costs = [1.0 + 10.0 * abs(g - _FORCE_GAMMA.value) for g in range(_GAMMA.value + 1)]
    return adaptive.AdaptiveGamma(max_gamma=_GAMMA.value, draft_cost=0.0, verify_costs=costs)

  def decode():
    kwargs = dict(sampling=sampling, max_new_tokens=_MAX_NEW.value, eos_id=None)
    if draft is None:
      result = speclm.autoregressive_decode(target, tokens, lengths, **kwargs)
    elif _MODE.value == 'adaptive':
      # `speculative_decode` runs the baseline loop for a rule that never drafts; a forced
      # γ = 0 profiles the adaptive loop's own γ = 0 rounds instead.
      result = speclm.speculative_decode(
          target, draft, tokens, lengths, gamma=adaptive_rule(),
          baseline_if_never_drafting=_FORCE_GAMMA.value is None, **kwargs)
    elif _MODE.value == 'tree':
      result = speclm.tree_speculative_decode(target, draft, tokens, lengths, tree=_tree(),
                                              **kwargs)
    else:
      result = speclm.speculative_decode(target, draft, tokens, lengths, gamma=_GAMMA.value,
                                         **kwargs)
    jax.block_until_ready(result.tokens)
    return result

  decode()  # compile
  trace_dir = _TRACE_DIR.value or tempfile.mkdtemp(prefix='speclm_trace_')
  with jax.profiler.trace(trace_dir):
    start = time.perf_counter()
    result = decode()
    seconds = time.perf_counter() - start
  calls = int(result.stats.target_calls)
  total, count = op_times(trace_dir)
  print(f'prompt tokens: {", ".join(str(int(n)) for n in lengths)}')
  print(f'{_MODE.value}, batch {_BATCH.value}, T={_TEMPERATURE.value:g}: {seconds:.2f}s for'
        f' {_MAX_NEW.value} tokens, {calls} target calls, {1e3 * seconds / calls:.1f} ms per call'
        f' (traced; tracing adds a little); ops sum to'
        f' {sum(total.values()) / 1e3 / calls:.1f} ms per call (both CPU threads)')
  print(f'{"ms / call":>10} {"runs / call":>12}  operation')
  for name, micros in total.most_common(_TOP.value):
    print(f'{micros / 1e3 / calls:10.2f} {count[name] / calls:12.1f}  {name}')
  if hlo_dir is not None:
    parts, part_count = profile_parts.part_times(
        trace_events(trace_dir), profile_parts.op_names(hlo_dir), _PART_DEPTH.value)
    print(f'inside the loop, by part: {sum(parts.values()) / 1e3 / calls:.1f} ms per call')
    print(f'{"ms / call":>10} {"runs / call":>12}  part')
    for name, micros in parts.most_common(_TOP.value):
      print(f'{micros / 1e3 / calls:10.2f} {part_count[name] / calls:12.1f}  {name}')
  print(f'trace: {trace_dir}')
  if result.stats.beta_count:
    print(f'α = {result.stats.alpha:.3f}')



if __name__ == '__main__':
  app.run(main)
