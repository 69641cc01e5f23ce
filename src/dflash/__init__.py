"""dflash: block-diffusion speculative decoding (DFlash) for Hugging Face causal LMs."""

from .config import DFlashConfig, default_target_layer_ids
from .errors import DFlashConfigError, DFlashError, DFlashInputError
from .generate import GenerationOutput, ar_generate, spec_generate, stream_generate
from .loading import DFlashLoadError, load_draft, load_target
from .model import DFlashDraftModel
from .sampling import SamplingParams

__all__ = [
    "DFlashConfig", "DFlashDraftModel", "DFlashError", "DFlashConfigError", "DFlashInputError", "DFlashLoadError",
    "GenerationOutput", "SamplingParams", "ar_generate", "spec_generate", "stream_generate", "load_target",
    "load_draft", "default_target_layer_ids",
]
__version__ = "0.1.0"
