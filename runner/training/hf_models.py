"""transformers' model modules as the trainer imports them: the one door through which runner.training
loads transformers' Llama and OLMoE (runner.training.model, runner.training.moe.olmoe).

Owns what loading them costs before a launch's first step. Two optional imports that no runner model
uses come with them when their package is installed, and while this module loads the model modules
transformers' probes for both read False:
- scipy: transformers' object-detection losses, which every model module imports through
  `transformers.loss.loss_utils`, import `scipy.optimize` at module level (0.3 s and about 320
  modules on a CPU here, more on a fresh host) for a Hungarian matcher no runner model has;
- scikit-learn: transformers 5.17 (the H200 image's) imports `sklearn.metrics` at module level in
  `generation/candidate_generator.py` (reached from every model class through GenerationMixin), for
  the ROC curve of assisted generation's confidence threshold; sklearn in turn imports scipy, pandas
  and pyarrow (cpu-tiny's launch here on the image's torch 2.11 and transformers 5.17: 6.74 s with
  them, 5.47 s without, `bench/bench_startup.py --cpu-tiny`; the `eval` extra installs sklearn with
  lm-eval). Newer transformers import it where it is used.
The real probes are back before anything else runs. A transformers module first imported inside
that window keeps the False it bound (`from ..utils import is_scipy_available`): in practice the
detection losses (their Hungarian matcher is missing in a trainer's process, which no runner model
calls) and the assisted-generation candidate generator (its confidence threshold stays fixed, which
the runner's greedy `generate` never reads); every module imported later, and the runner's own
scipy users (a forecast's fit), see scipy and sklearn as they are.
tests/training/test_launch_imports.py holds the launch's imports to this.
Never: builds, configures or patches a model (runner.training.model does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import transformers.utils as hf_utils

#: transformers' availability probes that read False while the model modules load (see above)
UNUSED_OPTIONAL = ("is_scipy_available", "is_sklearn_available")


@contextlib.contextmanager
def _without_unused_optional_imports() -> Iterator[None]:
    probes = {name: getattr(hf_utils, name) for name in UNUSED_OPTIONAL if hasattr(hf_utils, name)}
    for name in probes:
        setattr(hf_utils, name, lambda: False)
    try:
        yield
    finally:
        for name, probe in probes.items():
            setattr(hf_utils, name, probe)


with _without_unused_optional_imports():
    from transformers import LlamaConfig, LlamaForCausalLM, OlmoeConfig, OlmoeForCausalLM, masking_utils
    from transformers.models.llama import modeling_llama
    from transformers.models.olmoe import modeling_olmoe

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "OlmoeConfig",
    "OlmoeForCausalLM",
    "masking_utils",
    "modeling_llama",
    "modeling_olmoe",
]
