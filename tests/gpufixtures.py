"""The configs, batches, models and bodies of the GPU tests (tests/training/test_gpu.py), written once
for any device, so a CPU test (tests/training/test_gpu_setup.py) runs the same setup code and a
setup error (a config the schema cannot read, a plan that cannot count it) is caught without a GPU."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from runner.config.schema import ExperimentSchema
from runner.config.section import from_plain
from runner.planning.memory import saved_activation_bytes
from runner.training.memprobe import probe_training_forward
from runner.training.model import build_model, maybe_compile

TINY = dict(hidden_size=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=352, tie_embeddings=False)
VOCAB, MICRO, SEQ = 2048, 4, 256


def tiny_cfg(accelerator: str = "cuda", **model: Any) -> ExperimentSchema:
    """A typed experiment with every key the model, the planner and the probe read (defaults for the
    rest): the GPU tests' model at `accelerator`'s precision (bf16 on a GPU, fp32 on the CPU)."""
    return from_plain(
        ExperimentSchema,
        {
            "name": "gpu-test",
            "model": {**TINY, **model},
            "tokenizer": {"vocab_size": VOCAB, "eos_id": 0},
            "train": {"seq_len": SEQ, "micro_batch_sequences": MICRO, "global_batch_sequences": MICRO},
            "hardware": {
                "accelerator": accelerator,
                "precision": "bf16" if accelerator != "cpu" else "fp32",
                "memory_gib": 141,
            },
        },
    )


def batch(device: torch.device, vocab: int = VOCAB, b: int = MICRO, s: int = SEQ, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, s), generator=g).to(device)
    y = torch.randint(0, vocab, (b, s), generator=g).to(device)
    return x, y, torch.ones(b, s, dtype=torch.bool, device=device)


def tiny_model(device: torch.device, accelerator: str = "cuda", **model: Any):
    torch.manual_seed(0)
    return build_model(tiny_cfg(accelerator, **model)).to(device).train()


def regional_model(device: torch.device, accelerator: str = "cuda", backend: Any = "inductor"):
    cfg = tiny_cfg(accelerator, compile=True, compile_scope="regional")
    torch.manual_seed(0)
    return maybe_compile(build_model(cfg).to(device).train(), cfg, backend=backend)


def loss_grads(model, b, autocast_dtype: torch.dtype | None):
    model.zero_grad(set_to_none=True)
    x, y, m = b
    ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with ctx:
        loss = model(input_ids=x, loss_targets=y, loss_mask=m)
    (loss / m.sum()).backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def plan_and_probe(device: torch.device, loss: str, accelerator: str, autocast_dtype: torch.dtype | None):
    """(the planner's saved activation bytes, the saved-tensor probe) of the tiny model with `loss`."""
    cfg = tiny_cfg(accelerator, cross_entropy=loss)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    x, y, m = batch(device)
    probe = probe_training_forward(model, x, y, m, autocast_dtype=autocast_dtype)
    return saved_activation_bytes(cfg)["total"], probe


def staging_scenario(device: torch.device, b: int = MICRO, s: int = SEQ) -> dict[str, Any]:
    """The pinned checkpoint copy as the loop takes it (runner.training.staging.PinnedStaging): a tiny
    model trained one step on `device`, its state staged (prefilled buffers), the next optimizer step
    ordered after the copies, staged again. Returns what the tests check: the staged values against the
    state at the checkpoint, the model after the steps against a run that never staged, the buffers."""
    from runner.training.checkpoint import gather_full_state, training_tensors
    from runner.training.staging import PinnedStaging

    accelerator = "cpu" if device.type == "cpu" else "cuda"
    out: dict[str, Any] = {}
    for staged in (False, True):
        model = tiny_model(device, accelerator)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=device.type == "cuda")
        staging = PinnedStaging(device)
        prefill = staging.prefill(list(model.parameters()))
        prefill.join()
        after_prefill = staging.allocated_bytes
        data = batch(device, b=b, s=s)
        loss_grads(model, data, None)
        opt.step()
        at_checkpoint = {n: p.detach().clone() for n, p in model.named_parameters()}
        if staged:
            model_state, optim_state = gather_full_state(model, opt, to_host=False)
            first = staging.stage(model_state, optim_state, training_tensors(model, opt))
            loss_grads(model, data, None)
            staging.before_optimizer_step()
            opt.step()  # changes the parameters in place: the staged copy must not see it
            first.ready()
            out["staged_equal"] = all(
                torch.equal(first.model_state[n].cpu(), at_checkpoint[n].cpu()) for n in at_checkpoint
            )
            out["pinned"] = all(t.is_pinned() for t in first.model_state.values()) if device.type == "cuda" else None
            out["on_host"] = {t.device.type for t in first.model_state.values()}
            ptrs = [t.data_ptr() for t in first.model_state.values()]
            model_state, optim_state = gather_full_state(model, opt, to_host=False)
            second = staging.stage(model_state, optim_state, training_tensors(model, opt))
            second.ready()
            out["reused"] = ptrs == [t.data_ptr() for t in second.model_state.values()]  # name by name
            out["allocated_after_prefill"] = staging.allocated_bytes - after_prefill
            out["fresh"] = (first.allocated_bytes, second.allocated_bytes)
            out["second_equal"] = all(
                torch.equal(second.model_state[n].cpu(), p.detach().cpu()) for n, p in model.named_parameters()
            )
            out["staged_params"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        else:
            loss_grads(model, data, None)
            opt.step()
            out["reference_params"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return out


def checkpoint_copy_scenario(model_device: torch.device, device: torch.device, available_bytes: int) -> dict[str, Any]:
    """The loop's choice of rank 0's checkpoint copy (PinnedStaging.for_checkpoints, as runner.training.loop
    calls it) for the tiny model on `model_device`, an accelerator `device` and a host with `available_bytes`
    free: the bytes the buffers would take, the choice, and the staging when one was made (its prefill done)."""
    from types import SimpleNamespace

    from runner.training.staging import PinnedStaging, staging_bytes

    model = tiny_model(model_device, "cuda")
    acc = SimpleNamespace(device=device, is_main_process=True)
    staging, copy = PinnedStaging.for_checkpoints(acc, "none", model, available=lambda: available_bytes)
    if staging is not None and staging._prefill is not None:
        staging._prefill.join()
    return {"need": staging_bytes(model.parameters()), "copy": copy, "staging": staging}
