"""speclm: exact speculative decoding (Leviathan, Kalman & Matias, ICML 2023) in JAX."""

from speclm.adaptive import AdaptiveGamma
from speclm.decoding import DecodeResult
from speclm.decoding import DecodeStats
from speclm.decoding import StopReason
from speclm.decoding import autoregressive_decode
from speclm.decoding import speculative_decode
from speclm.protocol import LanguageModel
from speclm.protocol import Model
from speclm.sampling import GREEDY
from speclm.sampling import SamplingConfig
from speclm.text import Generation
from speclm.text import generate
from speclm.token_trees import DynamicTree
from speclm.token_trees import TreeShape
from speclm.tree_decoding import tree_speculative_decode

__all__ = [
    'AdaptiveGamma', 'DecodeResult', 'DecodeStats', 'DynamicTree', 'GREEDY', 'Generation',
    'LanguageModel', 'Model', 'SamplingConfig', 'StopReason', 'TreeShape',
    'autoregressive_decode', 'generate', 'speculative_decode', 'tree_speculative_decode',
]

__version__ = '0.1.0'
