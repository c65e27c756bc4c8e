"""Model families, one file each, found by ``model_type``: ``build_model``.

Every module of this package that declares ``MODEL_TYPES`` is a family whose
``Model`` serves those types (``models.base`` says what a family file
writes), so adding a family is adding its file.
"""

from __future__ import annotations

import importlib
import pkgutil

from pagedlm.models.base import DecoderLM


def find_families() -> dict[str, type[DecoderLM]]:
    """model_type -> model class, from every module of this package that declares ``MODEL_TYPES``."""
    families: dict[str, type[DecoderLM]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for model_type in getattr(module, "MODEL_TYPES", ()):
            if model_type in families:
                raise ImportError(f"model_type {model_type!r} is served by both "
                                  f"{families[model_type].__module__} and {module.__name__}")
            families[model_type] = module.Model
    return families


FAMILIES = find_families()


def build_model(config: dict) -> DecoderLM:
    """An un-loaded model for a Hugging Face config.json dict.

    Weights are random; load them with ``model.load_state_dict(model.sanitize(w))``.
    """
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")
    return family(family.args_class.from_dict(config))
