"""Test setup: JAX on the host CPU, float32, one compilation cache for the whole session, and
the tiny training-script run that two test modules share.

Compiling dominates this suite's time on a CPU: `llama.random_model` jits its initialisation
anew on every call (about 10 s for a 2-layer model on 2 cores), and every `python -m
speclm.run` or script a test starts compiles the same decode loops again. JAX's persistent
compilation cache, in a directory made for this session (and removed at its end, so every run
starts empty), lets a program compiled once be loaded wherever the same program is compiled
again, in this process or in the subprocesses tests start (they inherit the environment). It
stores XLA's executables keyed by the program, its shapes and the compile options: a hit runs
exactly what a compile would have produced. A JAX_COMPILATION_CACHE_DIR set by the caller is
used instead (and kept).
"""

import atexit
import gc
import os
import shutil
import tempfile
import types

import pytest

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
  _CACHE_DIR = tempfile.mkdtemp(prefix='speclm-tests-jax-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE_DIR
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
# Measured adaptive-γ costs (`calibration.cost_cache_dir`) and the CPU kernel's build
# (`cpu_matmul.library_path`) go to directories of this session too, removed at its end: a test
# run neither reads what earlier runs or jobs on this machine left in ~/.cache/speclm (a cached
# timing would skip the calibration a fresh CI machine has to run) nor writes there.
for _variable, _prefix in (('SPECLM_COST_CACHE', 'speclm-tests-costs-'),
                           ('SPECLM_KERNEL_CACHE', 'speclm-tests-kernels-')):
  if not os.environ.get(_variable):
    os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
    atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)
# XLA's CPU backend without LLVM's optimisation passes, and with its older loop emitters for
# fused element-wise work instead of the MLIR fusion emitters: compiling, which dominates the
# suite, takes about half the time with the first and 40% less again with the second on the
# tests' small models (a 4-layer target and 1-layer draft, greedy and sampled decodes: 6.2 s of
# XLA compiling, then 3.8 s), and their programs run about as fast. The semantics are the same
# (the tests compare programs built alike, or to tolerances); the benchmarks, the demo and
# every user run optimised code, and scripts/benchmark.py checks exactness there. Subprocesses
# inherit them; tests that set XLA_FLAGS for a subprocess append to it.
_TEST_XLA_FLAGS = {'--xla_backend_optimization_level': '0',
                   '--xla_cpu_use_fusion_emitters': 'false'}
for _flag, _value in _TEST_XLA_FLAGS.items():
  if _flag not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()
# Programs that take at least this long to compile are stored (JAX's default is 1 s).
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.3')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# scripts/train_smollm2_draft.py on tiny settings: 3 built-in prompts and up to 4 requests the
# target writes itself, replies of 6 tokens, greedy and once sampled; one prompt and sequence
# width (128) for every batch, so that each kind of decode and the training step compile once;
# α on 2 held-out and 2 demo prompts, 8 new tokens each.
DRAFT_SCRIPT_TINY = (
    '--num_prompts=3', '--self_prompts=4', '--self_prompt_tokens=48', '--gen_batch=4',
    '--max_new_tokens=6', '--sampled_replies=1', '--label_batch=4', '--label_top_k=8',
    '--batch_size=2', '--epochs=1', '--subset_size=512', '--eval_prompts=2',
    '--alpha_new_tokens=8', '--prompt_width=128', '--width_bucket=128',
    '--matmul_precision=highest')


@pytest.fixture(scope='session')
def draft_script_run(tmp_path_factory):
  """scripts/train_smollm2_draft.py, every stage, on the tiny settings with --noevaluate.

  A namespace: `work_dir` (the generated data and soft labels), `output_dir` (the draft file,
  no card yet), `run(*args)` (the script again, with the tiny settings) and `tiny_flags`.
  tests/test_train_draft_script.py checks this run; tests/test_train_eagle_script.py trains on
  a copy of the replies it generated (the EAGLE script's input is `--stage=generate`'s output),
  so SmolLM2 generates them once per session.
  """
  from speclm.testing.scripts import run_script  # pylint: disable=import-outside-toplevel
  script = os.path.join(_REPO, 'scripts', 'train_smollm2_draft.py')
  work = tmp_path_factory.mktemp('draft_work')
  out = tmp_path_factory.mktemp('draft_out')

  def run(*args):
    return run_script(script, *DRAFT_SCRIPT_TINY, *args)

  run(f'--work_dir={work}', f'--output_dir={out}', '--noevaluate')
  return types.SimpleNamespace(work_dir=str(work), output_dir=str(out), run=run,
                               tiny_flags=DRAFT_SCRIPT_TINY)


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs():
  """Drops every compiled program when a test module ends (the persistent cache keeps them).

  Each XLA:CPU executable keeps a few memory mappings for its machine code, and JAX's jit
  caches keep every executable a process compiled. A worker that ran some twenty modules in turn
  reached 64,098 mappings, just under Linux's default limit of 65,530 (vm.max_map_count);
  past it mmap fails and the worker dies with a segmentation fault in whatever allocates next
  (seen twice in CI, in `executable.serialize()` while test_t5 compiled). Clearing the caches
  between modules keeps a worker's count to what one module needs.
  """
  yield
  import jax  # pylint: disable=import-outside-toplevel  (after the environment above is set)
  jax.clear_caches()
  gc.collect()


# pytest-xdist (`-n 2` in pytest.ini): each test module runs whole on one worker, so its
# module-scoped fixtures (loaded models, compiled loops) are built once; the two modules that
# share the session's training-script run (`draft_script_run`) run on the same worker.
_SHARED_GROUPS = {'test_train_draft_script': 'draft_script',
                  'test_train_eagle_script': 'draft_script'}


# Groups are handed out in collection order: those with slow tests go first, so that the last
# group a worker takes is a short one.
@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
  groups = {}
  for item in items:
    module = item.module.__name__.rsplit('.', 1)[-1]
    groups[item] = _SHARED_GROUPS.get(module, module)
    item.add_marker(pytest.mark.xdist_group(groups[item]))
  slow = {groups[item] for item in items if item.get_closest_marker('slow')}
  items.sort(key=lambda item: groups[item] not in slow)  # stable: file order otherwise
