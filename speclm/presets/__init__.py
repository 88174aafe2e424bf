"""Ready-made models: the pairs speclm ships and the checkpoints it knows how to find.

The presets layer sits above the models and the checkpoint readers (it uses both) and below
analysis and the job:

  * `smollm2`: SmolLM2-135M-Instruct, the embedded default target (GGUF from a pip package),
    and its tokenizer;
  * `smollm2_draft`: the drafts shipped for it: a trained subset-vocabulary Llama in
    `speclm/assets/smollm2_draft/` (`load`), and the demo's, an EAGLE-3 draft in
    `speclm/assets/smollm2_eagle/` (`load_eagle`, which also reads any file
    `scripts/train_smollm2_eagle.py` wrote);
  * `t5`: a T5 whose parameters are restored from a checkpoint path (Hugging Face directory,
    T5X Orbax or legacy T5X), `load_t5(config, checkpoint_path)`.

Plain Python functions, no gin: the job layer registers what gin configures.
"""
