"""The model definitions; each implements `speclm.protocol.LanguageModel`. No gin, no checkpoints.

  llama         decoder-only Llama family and its relatives as config switches (Mistral,
                Qwen2/2.5, Qwen3, Gemma 2, Gemma 3)
  t5            T5 v1.0 / v1.1 encoder-decoder with T5X parameter names
  layers        blocks the models share (float32-accumulated dot, RMSNorm, tree attention)
  ngram         unigram and bigram drafts (c ≈ 0)
  lookup        the prompt-lookup (copy) draft, and lookup first over another draft
  subset_vocab  a draft whose head covers a token subset; a vocabulary padded to another length
  eagle         an EAGLE-style draft that reads the target's features
"""
