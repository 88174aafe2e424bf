"""Text in, text out for any decoder-only pair: `speclm.generate`.

    out = speclm.generate('models/Qwen3-1.7B', 'models/Qwen3-0.6B', ['Name three colours.'])
    print(out.texts[0], out.result.stats.alpha)

The target and the draft are checkpoint paths (a Hugging Face directory or a GGUF file, read by
`speclm.checkpoints.llm`) or loaded `speclm.Model`s; a draft of None decodes the target alone
(the baseline). The target's tokenizer (shipped with its checkpoint, or given) encodes the
prompts, through its chat template when it has one, stops each row at its end token and
decodes the replies. Speculative sampling compares p and q token by token, so the draft must
share the target's vocabulary: `check_same_tokenizer` refuses a draft whose tokenizer maps
tokens to other ids. A draft checkpoint whose embedding table is padded to another size (the
same tokens; Qwen2.5's small and large models) is fitted to the target's
(`subset_vocab.resize_vocabulary`, q̃ = 0 on ids it lacks); a loaded draft `Model` must have
the target's vocabulary size (`decoding.check_pair`).

This module sits above the checkpoint readers (it loads them by path, in `_load_model` and
`_load_tokenizer`, only when asked, so `import speclm` reads no checkpoint code).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import numpy as np

from speclm import adaptive
from speclm import decoding
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import token_trees
from speclm import tokenizer as tokenizer_lib
from speclm import tree_decoding
from speclm.models import subset_vocab

# A prompt: text, a conversation ([{'role': …, 'content': …}, …]) or token ids.
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `generate` returns: one reply per prompt, and the decode's full result.

  Attributes:
    texts: each row's generated tokens as text (cut before the end token, special tokens
      dropped).
    result: the `speclm.DecodeResult` (tokens, lengths, stop reasons, α and call counts).
  """

  texts: list[str]
  result: decoding.DecodeResult

  @property
  def tokens(self) -> list[list[int]]:
    """Each row's generated token ids (an end token included)."""
    return self.result.to_lists()


def generate(target: str | os.PathLike | protocol.Model,
             draft: str | os.PathLike | protocol.Model | None,
             prompts: Prompt | Sequence[Prompt],
             *,
             tokenizer: tokenizer_lib.Tokenizer | str | os.PathLike | None = None,
             chat: bool | None = None,
             max_new_tokens: int = 64,
             gamma: int | adaptive.AdaptiveGamma = 4,
             tree: token_trees.TreeShape | token_trees.DynamicTree | None = None,
             sampling: sampling_lib.SamplingConfig | None = None,
             temperature: float = 0.0,
             top_k: int = 0,
             top_p: float = 1.0,
             seed: int = 0,
             stop_at_eos: bool = True,
             dtype: str = 'float32',
             cpu_kernels: bool = False) -> Generation:
  """Decodes `prompts` with `target` (speculatively with `draft`) and returns the replies.

  Args:
    target, draft: a checkpoint path (Hugging Face directory or `.gguf` file) or a loaded
      `speclm.Model`; `draft=None` runs plain autoregressive decoding.
    prompts: one prompt or a list of them, decoded as one batch. A prompt is a string (a user
      message rendered with the chat template, or plain text; see `chat`), a conversation
      (a list of {'role', 'content'} dicts) or a list of token ids (used as they are).
    tokenizer: a `speclm.tokenizer.Tokenizer` or the checkpoint path it ships with; by default
      the target's own (required when the target is a loaded model).
    chat: strings are user messages rendered with the tokenizer's chat template (True), or
      plain text (False); None: chat exactly when the tokenizer has a template.
    max_new_tokens: the generation limit per row.
    gamma: tokens drafted per target call (γ ≥ 1), or a `speclm.AdaptiveGamma` rule.
    tree: a `speclm.TreeShape` or `speclm.DynamicTree`: verify a token tree per round
      (`speclm.tree_speculative_decode`) instead of a chain of γ.
    sampling: a `speclm.SamplingConfig`; or leave it None and set temperature, top_k, top_p
      (default: greedy).
    seed: the random seed of sampling.
    stop_at_eos: end a row at any of the tokenizer's end tokens (`Tokenizer.end_ids`: its
      eos and the checkpoint's others, e.g. a chat model's end of turn; else only at
      `max_new_tokens`).
    dtype, cpu_kernels: for models loaded here from a path: the parameter dtype ('float32',
      'bfloat16'), and on CPU every product through `speclm.kernels.cpu_matmul`
      (`llama.pack_for_cpu`: faster verification, a second copy of the weights).

  Greedy output (the default) equals the target's own greedy output, draft or not, token for
  token; sampled output follows the target's distribution exactly.
  """
  if sampling is None:
    sampling = sampling_lib.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  elif (temperature, top_k, top_p) != (0.0, 0, 1.0):
    raise ValueError('Give either sampling= or temperature/top_k/top_p, not both.')
  if tree is not None:
    tree = token_trees.check_tree(tree)
    if draft is None:
      raise ValueError('A token tree needs a draft model; pass one, or tree=None.')
  rows = _as_prompt_list(prompts)

  # Tokenizers first (cheap): a draft with another vocabulary fails before any model loads.
  if tokenizer is None:
    if isinstance(target, protocol.Model):
      raise ValueError('speclm.generate needs a tokenizer for a loaded target model: pass'
                       ' tokenizer= (a speclm.tokenizer.Tokenizer, or the checkpoint path it'
                       ' ships with), or give the target as its checkpoint path.')
    tokenizer = target
  tok = _load_tokenizer(tokenizer)
  same_tokenizer = False
  if draft is not None and not isinstance(draft, protocol.Model):
    same_tokenizer = check_draft_tokenizer(tok, draft)
  ids = [encode_prompt(tok, p, chat) for p in rows]

  target_model = _load_model(target, dtype, cpu_kernels)
  draft_model = None if draft is None else _load_model(draft, dtype, cpu_kernels)
  if tok.vocab_size > target_model.vocab_size:
    raise ValueError(f'The tokenizer has {tok.vocab_size} tokens but the target model only'
                     f' {target_model.vocab_size}: they do not belong together.')
  if draft_model is not None:
    if same_tokenizer:  # only the embedding tables' padding can differ
      draft_model = subset_vocab.resize_vocabulary(draft_model, target_model.vocab_size)
    decoding.check_pair(target_model, draft_model)

  tokens, lengths = tok.batch(ids)
  # One compiled loop per power-of-two prompt width, not one per prompt length.
  width = max(16, 1 << (tokens.shape[1] - 1).bit_length())
  pad_id = tok.pad_id if tok.pad_id is not None else 0
  tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=pad_id)
  common = dict(sampling=sampling, max_new_tokens=max_new_tokens, seed=seed,
                eos_id=list(tok.end_ids) if stop_at_eos and tok.end_ids else None,
                pad_id=pad_id)
  if draft_model is None:
    result = decoding.autoregressive_decode(target_model, tokens, lengths, **common)
  elif tree is not None:
    result = tree_decoding.tree_speculative_decode(target_model, draft_model, tokens, lengths,
                                                   tree=tree, **common)
  else:
    result = decoding.speculative_decode(target_model, draft_model, tokens, lengths,
                                         gamma=gamma, **common)
  return Generation(texts=tok.decode_result(result, stop_at_eos=stop_at_eos), result=result)


def encode_prompt(tok: tokenizer_lib.Tokenizer, prompt: Prompt, chat: bool | None = None
                  ) -> list[int]:
  """The token ids of one prompt, as `generate` encodes it (see its `prompts` and `chat`)."""
  if chat is None:
    chat = bool(tok.chat_template)
  if isinstance(prompt, str):
    if chat and not tok.chat_template:
      raise ValueError('chat=True, but the tokenizer has no chat template; pass chat=False to'
                       ' encode the prompts as plain text.')
    ids = tok.encode_chat(prompt) if chat else tok.encode(prompt)
  elif _is_conversation(prompt):
    if not tok.chat_template:
      raise ValueError('A conversation prompt needs a chat template, and the tokenizer has'
                       ' none; give plain text instead.')
    ids = tok.encode_chat(prompt)
  else:
    ids = _token_ids(prompt)
  if not ids:
    raise ValueError(f'The prompt {prompt!r} encodes to no tokens.')
  return ids


def check_same_tokenizer(target_tok: tokenizer_lib.Tokenizer,
                         draft_tok: tokenizer_lib.Tokenizer) -> None:
  """ValueError unless every id both tokenizers have names the same token in each (added
  tokens included). Ids only one of them has are not compared: a GGUF file lists padding
  entries up to the model's vocabulary size that the Hugging Face tokenizer leaves out."""
  ours = {i: t for t, i in target_tok.backend.get_vocab(with_added_tokens=True).items()}
  theirs = {i: t for t, i in draft_tok.backend.get_vocab(with_added_tokens=True).items()}
  differing = sorted(i for i in ours.keys() & theirs.keys() if ours[i] != theirs[i])
  if not differing:
    return
  first = differing[0]
  raise ValueError(
      f'The draft\'s tokenizer differs from the target\'s: {len(differing)} ids name other'
      f' tokens (id {first} is {ours[first]!r} in the target\'s, {theirs[first]!r} in the'
      ' draft\'s). Speculative sampling compares the two models\' distributions token by token,'
      ' so the draft must share the target\'s vocabulary (the same tokens with the same ids):'
      ' pick a draft of the same model family and tokenizer.')


def check_draft_tokenizer(target: tokenizer_lib.Tokenizer | str | os.PathLike,
                          draft_path: str | os.PathLike) -> bool:
  """`check_same_tokenizer` for the tokenizer shipped with the draft checkpoint at
  `draft_path` and the target's (a `Tokenizer` or its checkpoint path). Returns whether the
  two were compared: where either checkpoint ships none there is nothing to compare (the
  model vocabularies still are, by size)."""
  target_tok = _load_tokenizer(target, required=False)
  draft_tok = _load_tokenizer(draft_path, required=False)
  if target_tok is None or draft_tok is None:
    return False
  check_same_tokenizer(target_tok, draft_tok)
  return True


def _token_ids(prompt: Any) -> list[int]:
  """A prompt of token ids as a list of ints; anything but integers (floats that would be
  truncated, strings, nested lists) is a ValueError saying what was found.

  Args:
    prompt: `[P]` integer ids (a list, tuple or integer NumPy array).
  """
  if isinstance(prompt, np.ndarray) and not (np.issubdtype(prompt.dtype, np.integer)
                                             and prompt.ndim == 1):
    raise ValueError(f'Token ids must be a 1-D integer array, got a {prompt.ndim}-D'
                     f' {prompt.dtype} array; pass e.g. np.asarray(ids, np.int32).')
  try:
    items = list(prompt)
  except TypeError:
    raise ValueError(f'A prompt must be a string, a conversation or a list of token ids, got'
                     f' {type(prompt).__name__} {prompt!r}.') from None
  for item in items:
    if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
      raise ValueError(f'Token ids must be integers, got {item!r} ({type(item).__name__}) in'
                       ' a prompt; pass integer ids (np.int32), or text.')
  return [int(t) for t in items]


def _as_prompt_list(prompts) -> list[Prompt]:
  """`prompts` as a list of prompts (one string, conversation or id list becomes a list).

  An integer array is one prompt `[P]` or a batch `[B, P]`; a float array is a ValueError (its
  ids would be truncated)."""
  if isinstance(prompts, str) or _is_conversation(prompts):
    return [prompts]
  if isinstance(prompts, np.ndarray) and not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(f'Token ids must be integers, got a {prompts.dtype} array of shape'
                     f' {prompts.shape}; pass np.asarray(ids, np.int32), or text.')
  prompts = list(prompts)
  if prompts and all(isinstance(p, (int, np.integer)) for p in prompts):
    return [prompts]  # one prompt of token ids
  if prompts and all(isinstance(p, (int, float, np.number)) for p in prompts):
    raise ValueError(f'Token ids must be integers, got {prompts[:4]!r}; pass integer ids'
                     ' (np.int32), or text.')
  if not prompts:
    raise ValueError('No prompts: give a string, or a list of strings or token-id lists.')
  return prompts


def _is_conversation(prompt: Any) -> bool:
  return (isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0
          and all(isinstance(m, Mapping) for m in prompt))


def _load_tokenizer(source, *, required: bool = True) -> tokenizer_lib.Tokenizer | None:
  """A `Tokenizer` as given, or the one shipped with the checkpoint at path `source` (None
  where a checkpoint ships none and `required` is False)."""
  if isinstance(source, tokenizer_lib.Tokenizer):
    return source
  if not isinstance(source, (str, os.PathLike)):
    raise TypeError(f'tokenizer must be a speclm.tokenizer.Tokenizer or a checkpoint path, got'
                    f' {type(source).__name__}.')
  from speclm.checkpoints import llm  # pylint: disable=import-outside-toplevel
  try:
    return llm.load_llm_tokenizer(source)
  except FileNotFoundError as e:
    if not required:
      return None  # no tokenizer files (or no checkpoint, which loading it will report)
    if not os.path.exists(source):
      raise
    raise FileNotFoundError(f'{e} Pass tokenizer= (a speclm.tokenizer.Tokenizer or a'
                            ' checkpoint path with one).') from None


def _load_model(source, dtype: str, cpu_kernels: bool) -> protocol.Model:
  """`source` as given (a `Model`), or the checkpoint at path `source`."""
  if isinstance(source, protocol.Model):
    return source
  if not isinstance(source, (str, os.PathLike)):
    raise TypeError(f'A model must be a checkpoint path or a speclm.Model, got'
                    f' {type(source).__name__}.')
  from speclm.checkpoints import llm  # pylint: disable=import-outside-toplevel
  model = llm.load_llm(source, dtype=dtype)
  if cpu_kernels:
    from speclm.models import llama  # pylint: disable=import-outside-toplevel
    model = llama.pack_for_cpu(model)
  return model
