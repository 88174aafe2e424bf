r"""The gin-configured decoding job: `python -m speclm.run --gin_file=FILE …` (the job layer).

Decodes a dataset with speculative decoding, the plain baseline, or both, and writes an output
directory (see `speclm.outputs`): predictions.jsonl, metrics.json and the resolved config.gin.

  python -m speclm.run --gin_file=test_tiny.gin --gin.OUTPUT_DIR="'/tmp/tiny'"
  python -m speclm.run --gin_file=ende_small.gin \
      --gin.TARGET_CHECKPOINT="'gs://…/checkpoint_1000000'" \
      --gin.DRAFT_CHECKPOINT="'gs://…/checkpoint_1000000'" --gin.OUTPUT_DIR="'/tmp/ende'"

Flags, as in T5X: `--gin_file` (repeatable; found on the search path), `--gin_bindings`
(repeatable), `--gin.NAME=VALUE` (rewritten to the binding `NAME = VALUE`; strings need quotes:
`--gin.OUTPUT_DIR="'/tmp/x'"`), `--gin_search_paths` (comma-separated; the current directory
and the repository's `configs/` are always searched, after them).

Modes: 'speculative', 'baseline', 'compare' (both on the same batches and seeds; the report
says whether the outputs are identical, which greedy decoding guarantees).

Seams (each a zero-argument callable that gin passes uncalled, e.g. `@target/random_llama`;
all in `speclm.run.providers`):
  model provider       -> `speclm.protocol.Model`: `random_llama`; `smollm2_model` (the demo's
                          target) and its drafts `smollm2_eagle_draft_model` (the shipped
                          EAGLE-3 draft, or a file; the demo puts it behind prompt lookup,
                          `lookup_min_ngram = 2`) and `smollm2_draft_model` (2-layer);
                          `checkpoint_llm` (any Hugging Face or
                          GGUF decoder-only checkpoint), `t5_checkpoint_model`,
                          `checkpoint_model`; `ngram_draft`, `prompt_lookup_draft`; or any
                          function you register with gin
  vocabulary provider  -> `speclm.data.Vocabulary` (`ByteVocabulary`, `SentencePieceVocabulary`,
                          `FunctionVocabulary`), or any tokenizer with encode/decode/vocab_size
                          (`smollm2_tokenizer`, `smollm2_chat_vocabulary` (the demo's: each
                          input a chat message), `checkpoint_tokenizer`,
                          `checkpoint_chat_vocabulary`)
  dataset provider     -> list of `speclm.data.Example` (`builtin_prompts_dataset` (the
                          demo's), `file_dataset`, `synthetic_dataset`, `seqio_dataset`)

The package's modules:
  cli          the command line (absl flags, exit statuses)
  gin_cli      gin parsing shared with `python -m speclm.analysis`: --gin.NAME=VALUE, search path,
               errors that say what to change, checkpoint paths checked first
  providers    everything gin can name: model, vocabulary and dataset providers (Spec-Bench's
               conversations: `spec_bench_dataset`), settings
  job          run_job (gin's surface) as phases, and run_sweep
  settings     JobSettings: every run_job setting validated before anything is touched
  records      one batch decoded by each method into predictions.jsonl records
  turns        multi-turn datasets: a later turn after each method's own earlier reply
  merge        several processes: process 0 merges every share
  calibration  what the job measures before decoding: c and r(γ) (cached), the tree policy,
               and the measuring runs of `python -m speclm.analysis`
  loading      load_job: a job's models and encoded prompts, for other tools
  fingerprint  what determines a job's outputs (job.json), so a resume never mixes two jobs
  errors       JobError and its kinds
  compile_cache  the persistent compilation cache (on by default; `--nocompilation_cache`)
The report (metrics.json, the summary table, the table by category) is
`speclm.analysis.job_metrics` and `speclm.analysis.category_report`.
"""

from speclm.analysis.job_metrics import compute_metrics
from speclm.analysis.job_metrics import summary
from speclm.run.errors import BadLogitsError
from speclm.run.errors import Interrupted
from speclm.run.errors import JobError
from speclm.run.gin_cli import CONFIGS_DIR
from speclm.run.gin_cli import parse_gin
from speclm.run.gin_cli import rewrite_gin_args
from speclm.run.gin_cli import search_paths
from speclm.run.gin_cli import unset_required
from speclm.run.job import MODES
from speclm.run.loading import load_job
from speclm.run.job import run_job
from speclm.run.job import run_sweep
from speclm.run.providers import gamma_for_temperature
from speclm.run.providers import random_llama
from speclm.run.providers import t5_checkpoint_model

__all__ = [
    'BadLogitsError', 'CONFIGS_DIR', 'Interrupted', 'JobError', 'MODES', 'compute_metrics',
    'gamma_for_temperature', 'load_job', 'parse_gin', 'random_llama', 'rewrite_gin_args',
    'run_job', 'run_sweep', 'search_paths', 'summary', 't5_checkpoint_model', 'unset_required',
]
