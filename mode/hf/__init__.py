"""Hugging Face checkpoints in and out: dense Llama, Mistral and Qwen2, Mixture-of-Experts Mixtral
and Qwen2-MoE, and any mode model (MoD, MoDE) as the registered `mode` model type.

    python -m mode.hf import HF_FOLDER RUN_FOLDER [--max-seq-len N]
    python -m mode.hf export RUN_FOLDER HF_FOLDER [--family llama|mistral|qwen2|mixtral|qwen2_moe|mode]

Python API: `load_hf(folder)` -> (Config, LanguageModel) from a `save_pretrained` folder (config.json
and safetensors weights); `save_hf(model, cfg, folder, family)` writes one that
`transformers.AutoModelForCausalLM.from_pretrained` loads with the same logits. `import_run` /
`export_run` do the same between Hugging Face folders and mode run folders. Importing this package
registers model_type "mode" with transformers' AutoConfig and AutoModelForCausalLM (mode/hf/auto.py),
so a folder exported with family mode loads by from_pretrained. Needs the `hf` extra
(transformers, safetensors).
"""
import importlib.util
import sys
from typing import Any

__all__ = ["FAMILIES", "HFError", "export_run", "hf_config", "import_run", "load_hf", "save_hf"]


def __getattr__(name: str) -> Any:
    """The API from mode/hf/convert.py, imported on first use: `python -m mode.hf` starts (and
    installs its signal handlers) before torch is imported."""
    if name in __all__:
        from mode.hf import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'mode.hf' has no attribute {name!r}")


# `python -m mode.hf` imports this package while sys.argv[0] is "-m": its command registers nothing
# (and imports torch only after its signal handlers); `import mode.hf` registers the mode type.
if sys.argv[:1] != ["-m"] and importlib.util.find_spec("transformers") is not None:
    from mode.hf.auto import register

    register()
