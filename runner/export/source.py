"""What an export starts from: a run folder, one of its checkpoints that verifies, and its weights.

Owns: choosing the checkpoint (the run's final step, or `--step N`), refusing one that does not
verify (format 3 seals every file) or that was written under another experiment than its own saved
config says, and putting its weights into (a) the runner's own model (the reference the export is
compared with) and (b) transformers' plain classes (`LlamaForCausalLM`, `OlmoeForCausalLM`), whose
`save_pretrained` writes the folder. Never writes anything, and never builds `RunnerLlama` for the
folder: its class name would land in config.json's `architectures`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Glm4MoeForCausalLM, LlamaForCausalLM, OlmoeForCausalLM, PretrainedConfig
from transformers.utils import logging as hf_logging

from runner.config.load import Experiment, experiment_from_dict, find_project_root
from runner.errors import RunnerError
from runner.export.glm4moe import glm4moe_config, glm4moe_state
from runner.fsio import read_json
from runner.runs.checkpoints import dirname, verify
from runner.runs.folder import is_run_dir, not_a_run_dir
from runner.runs.runjson import as_record
from runner.training.checkpoint import Checkpoint
from runner.training.model import build_model, llama_config, olmoe_config
from runner.training.moe.deepseek import uses_deepseek_layers

#: how a refusal ends, per command that opens a checkpoint (`runner export`, `runner sample`)
REFUSING = {"export": "refusing to export it", "sample": "refusing to sample from it"}

#: attention backends a CPU runs; a GPU-only one (flash attention) is replaced by sdpa for the
#: reference model: the same function of the weights, computed by another kernel.
CPU_ATTENTION = ("sdpa", "eager")


@dataclass
class Source:
    """A run folder and the verified checkpoint an export is made of."""

    run_dir: Path
    run: dict  #: run.json
    exp: Experiment  #: the experiment the checkpoint was written under (its own saved config)
    checkpoint: Checkpoint
    final: bool  #: the checkpoint of the run's last committed step

    @property
    def step(self) -> int:
        return self.checkpoint.step


def open_source(run_dir: str | Path, step: int | None = None, command: str = "export") -> Source:
    """The run at `run_dir` and its checkpoint at `step` (default: the last committed step),
    verified; a damaged, missing or foreign checkpoint is a RunnerError naming the folder, worded
    for the `command` that opens it (`export`, `sample`)."""
    refusing = REFUSING[command]
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise not_a_run_dir(run_dir, "not a run folder (no run.json and experiment.yaml)")
    run = read_json(run_dir / "run.json")
    rec = as_record(run)
    committed = int(rec.committed_steps)
    chosen = committed if step is None else int(step)
    path = run_dir / "checkpoints" / dirname(chosen)
    if not path.is_dir():
        have = (
            sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
            if (run_dir / "checkpoints").is_dir()
            else []
        )
        hint = f"; checkpoints here: {', '.join(have)} (give --step N)" if have else "; the run has no checkpoint"
        what = f"step {chosen}" + ("" if step is not None else f", the run's last committed step ({rec.status})")
        raise RunnerError(f"no checkpoint of {what}{hint}", file=str(path))
    problem = verify(path)
    if problem is not None:
        raise RunnerError(f"checkpoint does not verify ({problem}): {refusing}", file=str(path))
    state = read_json(path / "state.json")
    if int(state.get("format", 1)) < 3 or not isinstance(state.get("config"), dict):
        raise RunnerError(
            f"a format-{state.get('format', 1)} checkpoint: `runner {command}` reads format 3 (resume the run once to "
            "rewrite it)",
            file=str(path),
        )
    root = Path(rec.project_root or find_project_root(Path.cwd()))
    if not root.is_dir():
        root = find_project_root(Path.cwd())
    exp = experiment_from_dict(state["config"], project_root=root, path=path / "state.json")
    if state.get("fingerprint") != exp.fingerprint:
        raise RunnerError(
            f"state.json's config resolves to fingerprint {exp.fingerprint[:12]}, the checkpoint records "
            f"{str(state.get('fingerprint'))[:12]}: {refusing}",
            file=str(path / "state.json"),
        )
    return Source(run_dir, run, exp, Checkpoint(path=path, step=int(state["step"]), state=state), chosen == committed)


def _cpu_config(exp: Experiment):
    """The experiment's config as this process builds it on a CPU: transformers' kernels, no compile."""
    m = exp.config.model
    attn = m.attn_implementation if m.attn_implementation in CPU_ATTENTION else "sdpa"
    model = dataclasses.replace(
        m, attn_implementation=attn, kernels="none", compile=False, activation_checkpointing=False
    )
    hardware = dataclasses.replace(exp.config.hardware, accelerator="cpu")
    return dataclasses.replace(exp.config, model=model, hardware=hardware)


def reference_model(src: Source) -> torch.nn.Module:
    """The runner's own model (build_model) with the checkpoint's weights, fp32, in eval mode."""
    model = build_model(_cpu_config(src.exp))
    model.load_state_dict(src.checkpoint.model_state(), strict=True)
    return model.eval()


def hf_config(src: Source) -> PretrainedConfig:
    """transformers' config of the run's model: every value training used, plus what a reader of
    the folder needs (the EOS as pad, a KV cache for generation)."""
    cfg = _cpu_config(src.exp)
    config: PretrainedConfig
    if uses_deepseek_layers(cfg):  # DeepSeek-V3 style: Glm4Moe, or refused naming the keys
        config, name = glm4moe_config(cfg), "Glm4MoeForCausalLM"
    else:
        config = copy.deepcopy(olmoe_config(cfg) if cfg.model.arch == "olmoe" else llama_config(cfg))
        name = "OlmoeForCausalLM" if cfg.model.arch == "olmoe" else "LlamaForCausalLM"
    config.architectures = [name]
    config.bos_token_id = bos_id(src.exp)
    config.eos_token_id = cfg.tokenizer.eos_id
    config.pad_token_id = cfg.tokenizer.eos_id  # packed training has no padding; batched generation needs an id
    config.use_cache = True
    return config


def bos_id(exp: Experiment) -> int | None:
    """The BOS id a recipe declares (none of today's do: pools hold documents and EOS only)."""
    value = getattr(exp.config.tokenizer, "bos_id", None)
    return int(value) if value is not None else None


def export_model(src: Source, dtype: torch.dtype) -> LlamaForCausalLM | OlmoeForCausalLM | Glm4MoeForCausalLM:
    """transformers' plain class with the checkpoint's weights (ties restored), cast to `dtype`."""
    config = hf_config(src)
    state = src.checkpoint.model_state()
    if config.architectures == ["Glm4MoeForCausalLM"]:
        model = Glm4MoeForCausalLM._from_config(config, dtype=torch.float32)
        state = glm4moe_state(state, model)
    else:
        cls = OlmoeForCausalLM if src.exp.config.model.arch == "olmoe" else LlamaForCausalLM
        model = cls._from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars and load reports are not ours to print (and a verification
    window may be longer than model_max_length, which transformers warns of)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
