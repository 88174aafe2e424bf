"""Everything gin can name in a job: providers of models, vocabularies, datasets and settings.

The library below the job layer imports no gin; this module gives its pieces their gin names.
A *provider* is a zero-argument callable that gin passes uncalled (`TARGET = @target/…`), so the
job loads things in a fixed order and turns a user's mistake into one clear line (`provide`).

  models        random_llama, t5_checkpoint_model, smollm2_model, smollm2_draft_model,
                smollm2_eagle_draft_model,
                ngram_draft, prompt_lookup_draft, checkpoint_llm (any decoder-only checkpoint:
                HF directory or GGUF file), checkpoint_model (path + any loader)
  vocabularies  ByteVocabulary, SentencePieceVocabulary, FunctionVocabulary, smollm2_tokenizer,
                smollm2_chat_vocabulary, checkpoint_tokenizer, checkpoint_chat_vocabulary
  datasets      file_dataset (`speclm.data.inputs.read_examples`), synthetic_dataset,
                seqio_dataset, builtin_prompts_dataset, spec_bench_dataset (conversations)
  settings      sampling_config, gamma_for_temperature, token_tree, dynamic_tree, tree_policy,
                T5Config (configs/models/*.gin),
                partitioning.Partitioner and its axis rules, partitioning.initialize_distributed
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Mapping, Sequence

import gin
import jax

from speclm import partitioning
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import text
from speclm import token_trees
from speclm.checkpoints import memory
from speclm.data import inputs as inputs_lib
from speclm.data import seqio_tasks
from speclm.data import vocab as vocab_lib
from speclm.models import llama
from speclm.models import t5
from speclm.run import errors
from speclm.run import gin_cli
from speclm.run.calibration import tree_policy as tree_policy_lib
from speclm.run.errors import JobError

# ----------------------------------------------------------------------------------------------
# Gin names for definitions that live below the job layer (selectors as before the split).

T5Config = gin.external_configurable(t5.T5Config, module='speclm.models.t5')
ByteVocabulary = gin.external_configurable(vocab_lib.ByteVocabulary, module='speclm.data.vocab')
FunctionVocabulary = gin.external_configurable(vocab_lib.FunctionVocabulary,
                                               module='speclm.data.vocab')
SentencePieceVocabulary = gin.external_configurable(vocab_lib.SentencePieceVocabulary,
                                                    module='speclm.data.vocab')
file_dataset = gin.external_configurable(inputs_lib.read_examples, name='file_dataset',
                                         module='speclm.data.inputs')
synthetic_dataset = gin.external_configurable(inputs_lib.synthetic_dataset,
                                              module='speclm.data.inputs')
seqio_dataset = gin.external_configurable(seqio_tasks.seqio_dataset,
                                          module='speclm.data.seqio_tasks')
Partitioner = gin.external_configurable(partitioning.Partitioner, module='speclm.partitioning')
standard_logical_axis_rules = gin.external_configurable(
    partitioning.standard_logical_axis_rules, module='speclm.partitioning')
replicated_logical_axis_rules = gin.external_configurable(
    partitioning.replicated_logical_axis_rules, module='speclm.partitioning')
initialize_distributed = gin.external_configurable(partitioning.initialize_distributed,
                                                   module='speclm.partitioning')




def t5_config_from_gin(gin_file: str, scope: str) -> t5.T5Config:
  """The `T5Config` a model gin file (configs/models/…) defines in `scope`, read on its own
  (e.g. `t5_config_from_gin('configs/models/t5_1_1/tiny.gin', 't5_1_1_tiny')`)."""
  gin.clear_config()
  try:
    gin.parse_config_file(gin_file)
    with gin.config_scope(scope):
      return T5Config()
  finally:
    gin.clear_config()


# ----------------------------------------------------------------------------------------------
# Settings and model providers


@gin.configurable
def sampling_config(temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0) -> sampling_lib.SamplingConfig:
  """`speclm.SamplingConfig` from gin (temperature 0 is greedy)."""
  return sampling_lib.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


@gin.configurable
def token_tree(paths: Sequence[Sequence[int]] | None = None,
               branching: Sequence[int] | None = None,
               candidates: str = 'top_k') -> token_trees.TreeShape:
  """A static token tree for `run_job.tree`: Medusa-style rank `paths` (`[[0], [1], [0, 0]]`)
  or a `branching` factor per depth (`[2, 2, 1]`); candidates 'top_k' (the draft's first
  choices) or 'sample' (drawn without replacement from its q̃)."""
  if (paths is None) == (branching is None):
    raise JobError('token_tree needs exactly one of paths (rank paths, e.g. [[0], [1], [0, 0]])'
                   ' and branching (children per depth, e.g. [2, 2, 1]).')
  if paths is not None:
    return token_trees.TreeShape.from_paths(paths, candidates)
  return token_trees.TreeShape.from_branching(branching, candidates)


@gin.configurable
def dynamic_tree(num_nodes: int = 16, depth: int = 5, top_k: int = 4,
                 width: int = 4) -> token_trees.DynamicTree:
  """EAGLE-2's dynamic token tree for `run_job.tree` (see `speclm.token_trees.DynamicTree`)."""
  return token_trees.DynamicTree(num_nodes=num_nodes, depth=depth, top_k=top_k, width=width)


@gin.configurable
def tree_policy(candidates: Mapping[str, Any] | None = None, calibration_rows: int = 4,
                calibration_tokens: int = 32, repeats: int = 2, allow_baseline: bool = False,
                min_tree_gain: float = 0.05) -> tree_policy_lib.TreePolicy:
  """`run_job.tree = @tree_policy()`: at start-up the job decodes at least
  `calibration_rows` rows (whole batches of its size, spread over its prompt lengths) with the
  baseline, the chain (its GAMMA) and every candidate tree, `calibration_tokens` tokens each
  (one untimed warm-up, then `repeats` timed, interleaved calls), and decodes everything
  with the fastest as measured (`speclm.run.calibration`).

  `candidates`: name -> a tree (`@a/token_tree()`, `@dynamic_tree()`), rank paths
  (`[[0], [1], [0, 0]]`) or None (the chain); the chain is always added. Default: the chain,
  'paths3', 'paths4' and 'dynamic8' (`tree_policy.default_candidates`).

  `allow_baseline = True`: the baseline competes too, and when no candidate measured faster
  than it the job decodes without speculation (metrics.json: `speculation` 'off'), so a
  large batch on a CPU, where verification costs nearly γ + 1 steps, is not made slower.
  `min_tree_gain`: a tree must measure this fraction faster than the chain to be chosen.
  """
  if candidates is None:
    candidates = tree_policy_lib.default_candidates()
  elif not isinstance(candidates, Mapping):
    raise JobError('tree_policy.candidates must be a dict name -> tree (e.g. {"paths3":'
                   f' [[0], [1], [0, 0]], "eagle": @dynamic_tree()}}), got {candidates!r}.')
  else:
    built = {}
    for name, tree in candidates.items():
      if callable(tree):  # a provider reference (@a/token_tree) given uncalled
        tree = provide(tree, f'tree_policy.candidates[{name!r}]')
      elif isinstance(tree, (list, tuple)):  # rank paths
        try:
          tree = token_trees.TreeShape.from_paths(tree)
        except (TypeError, ValueError) as e:
          raise JobError(f'tree_policy.candidates[{name!r}]: {e}') from None
      built[name] = tree
    candidates = built
  try:
    return tree_policy_lib.TreePolicy(candidates, calibration_rows=calibration_rows,
                                      calibration_tokens=calibration_tokens, repeats=repeats,
                                      allow_baseline=allow_baseline,
                                      min_tree_gain=min_tree_gain)
  except ValueError as e:
    raise JobError(f'tree_policy: {e}') from None


@gin.configurable
def gamma_for_temperature(temperature: float = gin.REQUIRED, at_0: int = gin.REQUIRED,
                          at_1: int = gin.REQUIRED) -> int:
  """The paper's γ for this temperature (Table 2 lists γ for temperature 0 and 1 only)."""
  if temperature == 0:
    return at_0
  if temperature == 1:
    return at_1
  raise JobError(f'The paper gives γ only for temperature 0 and 1, not {temperature}. Set γ'
                 ' yourself with --gin.GAMMA=5 (any integer >= 1).')


@gin.configurable
def random_llama(vocab_size: int = 259, embed_dim: int = 32, num_layers: int = 2,
                 num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
                 dtype: str = 'float32', partitioner=None, role: str = 'target',
                 max_position_embeddings: int | None = None) -> protocol.Model:
  """A Llama with random weights (tests, smoke runs). Models made with the same seed share the
  weights of the layers they have in common, so a 1-layer draft of a 2-layer target agrees
  with it more often than an unrelated model. `max_position_embeddings`: its context length
  (None: unlimited)."""
  config = llama.LlamaConfig(
      vocab_size=vocab_size, num_layers=num_layers, embed_dim=embed_dim, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=max(2, embed_dim // num_heads), mlp_dim=2 * embed_dim,
      param_dtype=dtype, dtype=dtype, max_position_embeddings=max_position_embeddings)
  definition = llama.Llama(config)
  # One compiled initializer per definition: eager Flax init dispatches every op one by one,
  # which costs seconds per model on a busy CPU.
  model = protocol.Model(definition, _jit_init(definition, jax.random.key(seed)))
  return model if partitioner is None else partitioner.shard_model(model, role)


@functools.partial(jax.jit, static_argnums=0)
def _jit_init(definition, rng):
  return definition.init_params(rng)


@gin.configurable
def checkpoint_model(path: str = gin.REQUIRED,
                     loader: Callable[[str], protocol.Model] = gin.REQUIRED) -> protocol.Model:
  """Model provider for any checkpoint format: checks `path` exists, then `loader(path)`."""
  errors.check_path(path, 'checkpoint')
  return loader(path)


@gin.configurable
def t5_checkpoint_model(config: Any = gin.REQUIRED, checkpoint_path: str = gin.REQUIRED,
                        dtype: str | None = None, partitioner=None,
                        role: str = 'target', cpu_kernels: bool = False) -> protocol.Model:
  """A T5 (`speclm.models.t5`) restored from a T5X or Hugging Face checkpoint.

  `config` is a `T5Config`, e.g. the macro `%T5_1_1_XXL` of configs/models/t5_1_1/xxl.gin;
  scope the provider per model (`target/t5_checkpoint_model.config = %T5_1_1_XXL`) so the target
  and the draft can differ. `dtype` (e.g. 'bfloat16') overrides the config's dtypes.
  With the job's `partitioner` (run_job passes it), a legacy T5X checkpoint is read straight
  into its shards (each device reads its slice); other formats are read, then sharded.
  `cpu_kernels`: for float32 jobs on one CPU, every product through
  `speclm.kernels.cpu_matmul` (`t5.pack_for_cpu`; a no-op elsewhere).
  """
  errors.check_path(checkpoint_path, 'checkpoint')
  from speclm.checkpoints import t5x  # pylint: disable=g-import-not-at-top
  from speclm.presets import t5 as t5_presets  # pylint: disable=g-import-not-at-top
  try:
    return t5_presets.load_t5(config, checkpoint_path, dtype=dtype, partitioner=partitioner,
                              role=role, cpu_kernels=cpu_kernels)
  except t5x.CheckpointError as e:
    raise JobError(str(e)) from None


@gin.configurable
def checkpoint_llm(path: str = gin.REQUIRED, dtype: str = 'float32', cpu_kernels: bool = False,
                   draft_for: str | None = None, quantized: bool = False) -> protocol.Model:
  """Any decoder-only checkpoint speclm reads (`speclm.checkpoints.llm.load_llm`): a Hugging
  Face directory (Llama, Mistral, Qwen2/2.5/3, Gemma 2/3) or a GGUF file.

  `draft_for`: the target's checkpoint path, when this model is its draft. The tokenizers
  shipped with the two must agree, id for id (`speclm.text.check_draft_tokenizer`), and a
  draft whose embedding table is padded to another size than the target's is fitted to it
  (`subset_vocab.resize_vocabulary`: q̃ = 0 on ids it lacks, still exact).
  `cpu_kernels`: as for `smollm2_model` (off by default: it keeps a second copy of the
  weights).
  `quantized`: a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K matrices stay as stored and are
  multiplied by `speclm.kernels.quantized` (about 0.56 bytes a 4-bit weight instead of 4, or
  8 with `cpu_kernels`); float32 activations on one CPU device only. Ignored, with a warning,
  where the kernel cannot serve (several devices, bfloat16, no compiler, a Hugging Face
  directory).
  """
  errors.check_path(path, 'checkpoint')
  from speclm.checkpoints import llm  # pylint: disable=g-import-not-at-top
  from speclm.models import subset_vocab  # pylint: disable=g-import-not-at-top
  target_vocab_size = None
  if draft_for is not None:
    errors.check_path(draft_for, 'target checkpoint')
    if text.check_draft_tokenizer(draft_for, path):  # then only the tables' padding differs
      target_vocab_size = llm.read_llm_config(draft_for).vocab_size
  config = llm.read_llm_config(path)
  resized = target_vocab_size not in (None, config.vocab_size)
  quantized = quantized and _quantized_usable(path, dtype, resized)
  stored = None
  if quantized:
    from speclm.checkpoints import gguf  # pylint: disable=g-import-not-at-top
    stored = gguf.stored_sizes(path, config)
  memory.check_fits(f'The checkpoint {path}',
                    memory.estimate_bytes(config, dtype, cpu_kernels, stored),
                    _held_as(dtype, cpu_kernels, quantized))
  model = llm.load_llm(path, dtype=dtype, quantized=quantized)
  if cpu_kernels:
    model = llama.pack_for_cpu(model)
  if target_vocab_size is not None:
    model = subset_vocab.resize_vocabulary(model, target_vocab_size)
  return model


@gin.configurable
def checkpoint_tokenizer(path: str = gin.REQUIRED):
  """The tokenizer shipped with the checkpoint at `path` (a `speclm.tokenizer.Tokenizer`, used
  as the job's vocabulary): each input is encoded as plain text."""
  errors.check_path(path, 'tokenizer')
  from speclm.checkpoints import llm  # pylint: disable=g-import-not-at-top
  return llm.load_llm_tokenizer(path)


@gin.configurable
def checkpoint_chat_vocabulary(path: str = gin.REQUIRED) -> vocab_lib.Vocabulary:
  """The tokenizer of the checkpoint at `path` with its chat template: each input is a user
  message (as `speclm.generate` encodes a string)."""
  errors.check_path(path, 'tokenizer')
  from speclm.checkpoints import llm  # pylint: disable=g-import-not-at-top
  tok = llm.load_llm_tokenizer(path)
  if not tok.chat_template:
    raise JobError(f'The tokenizer at {path} has no chat template: encode its inputs as plain'
                   ' text with VOCABULARY = @checkpoint_tokenizer (checkpoint_tokenizer.path).')
  return _chat_vocabulary(tok)


def _chat_vocabulary(tok) -> vocab_lib.Vocabulary:
  """A `speclm.tokenizer.Tokenizer` as a vocabulary whose inputs are chat user messages (and
  whose `encode_conversation` renders a whole conversation with the same template)."""
  return vocab_lib.FunctionVocabulary(tok.encode_chat, tok.decode, tok.vocab_size,
                                      eos_id=tok.eos_id, pad_id=tok.pad_id or 0,
                                      end_ids=tok.end_ids, conversation_fn=tok.encode_chat)


@gin.configurable
def smollm2_model(dtype: str = 'float32', cpu_kernels: bool = True,
                  quantized: bool = False) -> protocol.Model:
  """SmolLM2-135M-Instruct from its pip-installed GGUF file (`speclm.presets.smollm2`).

  `cpu_kernels`: every projection through `speclm.kernels.cpu_matmul` on a one-device CPU
  job (`llama.pack_for_cpu`; a no-op elsewhere).
  `quantized`: the file's Q4_1 matrices and Q8_0 table kept as stored (97 MB instead of
  1.19 GB), through `speclm.kernels.quantized` (see `checkpoint_llm`).
  """
  from speclm.presets import smollm2  # pylint: disable=g-import-not-at-top
  quantized = quantized and _quantized_usable(smollm2.gguf_path(), dtype, False)
  config = smollm2.config()
  stored = None
  if quantized:
    from speclm.checkpoints import gguf  # pylint: disable=g-import-not-at-top
    stored = gguf.stored_sizes(smollm2.gguf_file(), config)
  memory.check_fits('SmolLM2-135M', memory.estimate_bytes(config, dtype, cpu_kernels, stored),
                    _held_as(dtype, cpu_kernels, quantized))
  return smollm2.load_model(dtype, cpu_kernels, quantized)


def _held_as(dtype: str, cpu_kernels: bool, quantized: bool = False) -> str:
  """How a provider holds the weights, for `memory.check_fits`' message."""
  return ('quantized matrices as stored, the rest ' if quantized else '') + dtype + (
      ', with a second copy packed for the CPU kernel' if cpu_kernels else '')


def _quantized_usable(path: str, dtype: str, resized: bool) -> bool:
  """Whether `checkpoint_llm.quantized` can be honoured: a GGUF file, float32 activations, one
  CPU device, the kernel built, and not a draft whose table is fitted to its target's size."""
  from speclm.checkpoints import llm  # pylint: disable=g-import-not-at-top
  from speclm.kernels import quantized  # pylint: disable=g-import-not-at-top
  reason = None
  if llm.checkpoint_kind(path) != 'gguf':
    reason = 'it is not a GGUF file'
  elif dtype != 'float32' or not llama.cpu_kernels_usable(dtype):
    reason = ('the quantized kernel needs float32 activations on one CPU device'
              + ('' if quantized.available() else ' and its build failed'))
  elif resized:
    reason = "a draft whose table is padded to its target's size is held as float32"
  if reason is not None:
    gin_cli.warn(f'checkpoint_llm.quantized is ignored for {path}: {reason}; its matrices are'
                 ' dequantized.')
  return reason is None


@gin.configurable
def smollm2_tokenizer():
  """SmolLM2's tokenizer (a `speclm.tokenizer.Tokenizer`; used as the job's vocabulary)."""
  from speclm.presets import smollm2  # pylint: disable=g-import-not-at-top
  return smollm2.load_tokenizer()


@gin.configurable
def ngram_draft(path: str = gin.REQUIRED) -> protocol.Model:
  """A unigram or bigram draft saved by `speclm.models.ngram.save`."""
  errors.check_path(path, 'n-gram draft')
  from speclm.models import ngram  # pylint: disable=g-import-not-at-top
  return ngram.load(path)


@gin.configurable
def prompt_lookup_draft(vocab_size: int = gin.REQUIRED, max_ngram: int = 3,
                        min_ngram: int = 1) -> protocol.Model:
  """The prompt-lookup (copy) draft of `speclm.models.lookup`."""
  from speclm.models import lookup  # pylint: disable=g-import-not-at-top
  return lookup.prompt_lookup(vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)


@gin.configurable
def smollm2_draft_model(path: str | None = None, dtype: str = 'float32',
                        cpu_kernels: bool = True, lookup_min_ngram: int = 0,
                        lookup_weight: float = 1.0) -> protocol.Model:
  """The trained draft shipped for SmolLM2-135M (`speclm.presets.smollm2_draft`).

  It borrows SmolLM2's token embeddings, so loading it also loads (once) the target.
  `cpu_kernels`: as for `smollm2_model`. `lookup_min_ngram` n > 0: prompt lookup proposes
  instead wherever the last n+ tokens occurred before (`speclm.models.lookup.lookup_first`);
  demo.gin sets n = 2 for both SmolLM2 drafts. `lookup_weight` w < 1: there q is
  w·δ(the lookup's token) + (1 − w)·the draft's q instead (the same drafts at T = 0 for
  w ≥ 1/2; `speclm.models.lookup.LookupFirst`).
  """
  if path is not None:
    errors.check_path(path, 'SmolLM2 draft')
  from speclm.presets import smollm2  # pylint: disable=g-import-not-at-top
  from speclm.presets import smollm2_draft  # pylint: disable=g-import-not-at-top
  return _behind_lookup_first(
      lambda: smollm2_draft.load(smollm2.load_model(dtype), path, dtype, cpu_kernels),
      lookup_min_ngram, lookup_weight)


def _behind_lookup_first(load_draft: Callable[[], protocol.Model],
                         lookup_min_ngram: int, lookup_weight: float) -> protocol.Model:
  """`load_draft()`, behind prompt lookup where the last `lookup_min_ngram`+ tokens occurred
  before (`speclm.models.lookup.lookup_first`; 0: the draft alone), its proposal mixed in
  with weight `lookup_weight` (1: it overrides the draft's q; `LookupFirst.lookup_weight`).
  The settings are checked before the draft is loaded."""
  if lookup_min_ngram < 0:
    raise JobError(f'lookup_min_ngram must be >= 0 (0: off), got {lookup_min_ngram}.')
  if not 0.0 < lookup_weight <= 1.0:
    raise JobError(f'lookup_weight must be in (0, 1] (1: the lookup overrides the draft),'
                   f' got {lookup_weight}.')
  draft = load_draft()
  if not lookup_min_ngram:
    return draft
  from speclm.models import lookup  # pylint: disable=g-import-not-at-top
  return lookup.lookup_first(draft, min_ngram=lookup_min_ngram, weight=lookup_weight)


@gin.configurable
def smollm2_eagle_draft_model(path: str | None = None, cpu_kernels: bool = True,
                              lookup_min_ngram: int = 0,
                              lookup_weight: float = 1.0) -> protocol.Model:
  """An EAGLE-style draft for SmolLM2-135M that reads the target's features
  (`speclm.presets.smollm2_draft.load_eagle`): the EAGLE-3 draft shipped in
  speclm/assets/smollm2_eagle/ (path None), or a file `scripts/train_smollm2_eagle.py` wrote.

  `cpu_kernels`, `lookup_min_ngram` and `lookup_weight` as for `smollm2_draft_model` (prompt
  lookup first, the feature draft elsewhere: `speclm.models.lookup.LookupFirstWithFeatures`).
  """
  from speclm.presets import smollm2  # pylint: disable=g-import-not-at-top
  from speclm.presets import smollm2_draft  # pylint: disable=g-import-not-at-top
  if path is None:
    path = os.path.join(smollm2_draft.EAGLE_DIR, smollm2_draft.EAGLE_FILE)
    if not os.path.exists(path):
      raise JobError(f'The shipped EAGLE-3 draft is missing ({path}): reinstall speclm, or'
                     ' set smollm2_eagle_draft_model.path to a file'
                     ' scripts/train_smollm2_eagle.py wrote (or use @smollm2_draft_model).')
  errors.check_path(path, 'SmolLM2 EAGLE draft')
  return _behind_lookup_first(
      lambda: smollm2_draft.load_eagle(smollm2.load_model(), path, cpu_kernels),
      lookup_min_ngram, lookup_weight)


@gin.configurable
def smollm2_chat_vocabulary() -> vocab_lib.Vocabulary:
  """SmolLM2's tokenizer with its chat template: each input is a user message."""
  from speclm.presets import smollm2  # pylint: disable=g-import-not-at-top
  return _chat_vocabulary(smollm2.load_tokenizer())


@gin.configurable
def builtin_prompts_dataset(name: str = 'demo', count: int | None = None
                            ) -> list[inputs_lib.Example]:
  """A built-in prompt set of `speclm.data.builtin_prompts`: 'demo', 'heldout' or 'training'."""
  from speclm.data import builtin_prompts  # pylint: disable=g-import-not-at-top
  sets = {'demo': builtin_prompts.demo_prompts, 'heldout': builtin_prompts.heldout_prompts,
          'training': builtin_prompts.training_prompts}
  if name not in sets:
    raise JobError(f'builtin_prompts_dataset.name must be one of {sorted(sets)}, got {name!r}.')
  prompts = sets[name]() if count is None else sets[name](count)
  return [inputs_lib.Example(index=i, id=f'{name}-{i}', input=p) for i, p in enumerate(prompts)]


@gin.configurable
def spec_bench_dataset(path: str = gin.REQUIRED, per_category: int | None = None,
                       group_mt_bench: bool = True) -> list[inputs_lib.Example]:
  """Conversations of a question file in Spec-Bench's format, one example per turn
  (`speclm.data.conversations.read_conversations`; later turns follow the model's own reply).

  Args:
    path: the JSONL file (question_id, category, turns).
    per_category: the first N conversations of each category (file order); None: all.
    group_mt_bench: report MT-bench's eight categories as the one task 'mt_bench', as
      Spec-Bench's leaderboard does (`per_category` then counts the task).
  """
  from speclm.data import conversations  # pylint: disable=g-import-not-at-top
  return conversations.read_conversations(
      path, per_category=per_category,
      category_map=conversations.SPEC_BENCH_TASKS if group_mt_bench else None)


# ----------------------------------------------------------------------------------------------
# Calling a provider


def as_vocabulary(obj: Any) -> vocab_lib.Vocabulary:
  """A `Vocabulary`, or any tokenizer with encode, decode, vocab_size and eos_id, adapted."""
  if isinstance(obj, vocab_lib.Vocabulary):
    return obj
  if not all(hasattr(obj, name) for name in ('encode', 'decode', 'vocab_size')):
    raise JobError(f'The vocabulary provider returned {type(obj).__name__}, which has no'
                   ' encode/decode/vocab_size; wrap it in FunctionVocabulary.')
  return vocab_lib.FunctionVocabulary(obj.encode, obj.decode, obj.vocab_size,
                                      eos_id=getattr(obj, 'eos_id', None),
                                      pad_id=getattr(obj, 'pad_id', None) or 0,
                                      end_ids=getattr(obj, 'end_ids', ()))


def _accepted_kwargs(provider: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
  """The entries of `kwargs` that `provider` takes as parameters (e.g. `partitioner`)."""
  if not kwargs:
    return {}
  try:
    params = inspect.signature(provider).parameters
  except (TypeError, ValueError):
    return {}
  return {k: v for k, v in kwargs.items() if k in params}


def provide(provider: Any, what: str, expected: type | None = None, **kwargs):
  """Calls a provider (or passes a ready object through), turning every error into JobError.

  A known kind (a missing file or setting, bad data, a broken checkpoint: `CheckpointError`)
  becomes its message; any other exception `errors.unexpected`'s one line, its cause kept for
  `--verbose`. KeyboardInterrupt passes (the job reports it as `Interrupted`).

  `kwargs` (e.g. the job's partitioner and the model's role) go to providers that accept them.
  """
  try:
    value = provider(**_accepted_kwargs(provider, kwargs)) if callable(provider) and not (
        expected is not None and isinstance(provider, expected)) else provider
  except JobError as e:
    raise JobError(f'{what}: {e.message}') from None
  except (FileNotFoundError, inputs_lib.DataError, ImportError) as e:
    raise JobError(f'{what} failed: {_clean(e)}') from None
  except TypeError as e:
    missing = _missing_setting(provider, kwargs)
    if missing is None:
      raise errors.unexpected(e, what) from e
    raise JobError(f'{what}: {missing} is not set. Set it in a gin file ({missing} = …) or on the'
                   f' command line (--gin.{missing}=…).') from None
  except ValueError as e:  # CheckpointError, TokenizerFileError, ChatTemplateError among them
    raise JobError(f'{what} failed: {_first_paragraph(e)}') from e
  except Exception as e:  # pylint: disable=broad-except  # anything else: still one line
    raise errors.unexpected(e, what) from e
  if expected is not None and not isinstance(value, expected):
    raise JobError(f'{what} returned {type(value).__name__}, expected {expected.__name__}.')
  return value


def _missing_setting(provider: Any, kwargs: Mapping[str, Any]) -> str | None:
  """'file_dataset.path' when the configurable `provider` (as gin passed it) has a parameter
  without a default that neither a binding nor `kwargs` sets: the TypeError of its call."""
  reference = gin_cli.reference_to(provider)
  if reference is None:
    return None
  configurable = reference.configurable
  missing = [name for name in gin_cli.unbound_parameters(reference.scopes, configurable.selector,
                                                         inspect.Parameter.empty)
             if name not in kwargs]
  return f'{configurable.name}.{missing[0]}' if missing else None


def _clean(error: BaseException) -> str:
  """The error's message without the lines gin appends ("In call to configurable …")."""
  lines = [line for line in str(error).splitlines()
           if not line.strip().startswith(('In call to configurable', 'In scope'))]
  return '\n'.join(lines).strip()


def _first_paragraph(error: Exception) -> str:
  return _clean(error).split('\n\n')[0].strip()
