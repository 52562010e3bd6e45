"""The runner's mixture-of-experts layer (runner.training.moe): equal to transformers' OLMoE, loads
its checkpoints, keeps the router probe's records, and compiles as one graph per decoder layer with
no graph break and no host sync."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import OlmoeForCausalLM

from runner.config.load import load_experiment
from runner.training import experts
from runner.training.model import _build_olmoe, build_model, maybe_compile, olmoe_config
from runner.training.moe import MoELayer, SoftmaxTopKRouter
from runner.training.moe import layer as moe_layer

REPO = Path(__file__).resolve().parents[2]
ONE_PROCESS = type("Acc", (), {"num_processes": 1, "device": torch.device("cpu")})()


def _cfg(**model):
    """experiments/cpu-tiny-moe.yaml (2 layers, 8 experts of 64, k 2, hidden 64), model keys replaced."""
    cfg = load_experiment(REPO / "experiments/cpu-tiny-moe.yaml", check_files=False).config
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def _ids(cfg, sequences: int = 2, seed: int = 1, positions: int = 32) -> torch.Tensor:
    return torch.randint(1, 4096, (sequences, positions), generator=torch.Generator().manual_seed(seed))


def _transformers_copy(model, cfg) -> OlmoeForCausalLM:
    """transformers' own OlmoeForCausalLM (its eager per-expert loop) holding `model`'s weights."""
    ref = OlmoeForCausalLM._from_config(olmoe_config(cfg), attn_implementation="sdpa", experts_implementation="eager")
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref


def _loss_and_grads(model, ids, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_olmoe_recipes_build_the_runners_layer_with_transformers_parameter_names():
    cfg = _cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    torch.manual_seed(0)
    before = _build_olmoe(cfg, "sdpa", "eager")  # transformers' block: the path trained before
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.model.layers)
    assert isinstance(model.model.layers[0].mlp.gate, SoftmaxTopKRouter)
    want, got = before.state_dict(), model.state_dict()
    assert list(got) == list(want)  # same names, same order: checkpoints and exports unchanged
    assert all(torch.equal(got[k], want[k]) for k in want)  # same initial weights from the same seed
    assert "model.layers.1.mlp.experts.gate_up_proj" in got and "model.layers.1.mlp.gate.weight" in got


def test_logits_and_gradients_equal_transformers_olmoe_in_fp32():
    cfg = _cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    ref = _transformers_copy(model, cfg)
    ids = _ids(cfg)
    logits, grads = _loss_and_grads(model, ids)
    want_logits, want_grads = _loss_and_grads(ref, ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    # transformers' router logits and its load-balancing loss (output_router_logits) are unchanged
    with torch.no_grad():
        out, want = model(input_ids=ids, output_router_logits=True), ref(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == cfg.model.n_layers
    for a, b in zip(out.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-6)


def test_under_bf16_autocast_the_grouped_matmuls_run_bf16_and_match_transformers_within_bf16_tolerance(monkeypatch):
    cfg = _cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    ref = _transformers_copy(model, cfg)
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = F.grouped_mm

    def spy(x, w, *args, **kwargs):
        seen.append((x.dtype, w.dtype))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", spy)
    ids = _ids(cfg)
    logits, grads = _loss_and_grads(model, ids, autocast=True)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * (2 * cfg.model.n_layers)  # gate_up and down per layer
    want_logits, want_grads = _loss_and_grads(ref, ids, autocast=True)
    torch.testing.assert_close(logits, want_logits, rtol=2e-2, atol=2e-2)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert grads[name].dtype == torch.float32  # the parameters and their gradients stay fp32
        torch.testing.assert_close(grads[name], want_grads[name], rtol=5e-2, atol=5e-4, msg=name)


def test_softmax_router_normalises_top_k_as_olmoe_when_its_config_says_so():
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

    for norm in (False, True):
        config = olmoe_config(_cfg())
        config.norm_topk_prob = norm
        theirs = OlmoeTopKRouter(config)
        torch.nn.init.normal_(theirs.weight)
        ours = SoftmaxTopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok, norm)
        ours.weight = theirs.weight
        x = torch.randn(32, config.hidden_size)
        logits, weights, indices = theirs(x)
        out = ours(x)
        assert torch.equal(out.experts, indices) and torch.equal(out.logits, logits)
        torch.testing.assert_close(out.weights, weights, rtol=0, atol=0)
        assert torch.allclose(out.weights.sum(-1), torch.ones(32)) == norm


def test_a_checkpoint_of_transformers_block_loads_exactly_and_trains_on_within_tolerance():
    """The op order differs from transformers' per-expert loop, so the continuation is close, not bit-identical."""
    cfg = _cfg()
    batches = [_ids(cfg, seed=s) for s in range(4)]

    def train(model, opt, steps):
        losses = []
        for ids in steps:
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    old = _build_olmoe(cfg, "sdpa", "eager")
    old_opt = torch.optim.AdamW(old.parameters(), lr=1e-3)
    train(old, old_opt, batches[:2])
    # copies, as a checkpoint on disk is (an optimizer's state_dict shares its moment tensors)
    model_state, optim_state = copy.deepcopy(old.state_dict()), copy.deepcopy(old_opt.state_dict())
    new = build_model(cfg)
    new.load_state_dict(model_state, strict=True)
    assert all(torch.equal(new.state_dict()[k], v) for k, v in model_state.items())
    new_opt = torch.optim.AdamW(new.parameters(), lr=1e-3)
    new_opt.load_state_dict(optim_state)
    went_on = train(new, new_opt, batches[2:])
    continued = train(old, old_opt, batches[2:])
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(went_on, continued))
    for (name, a), b in zip(new.named_parameters(), old.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


class SyncWatch:
    """A torch.compile backend (aot_eager's, with eyes): counts the frames dynamo compiles and reads
    every forward and backward graph for what makes a host sync: a tensor value read back to Python
    (`aten._local_scalar_dense`: .item(), .tolist()) or a size that depends on data (an unbacked
    symbol: nonzero, bincount, unique, masked_select). torch 2.13 traces both into a fullgraph
    rather than breaking, so fullgraph alone does not prove the layer sync-free."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.frames, self.graphs, self.syncs = 0, {"forward": 0, "backward": 0}, []

        def watch(kind):
            def compiler(gm, example_inputs):
                self.graphs[kind] += 1
                self._read(gm, kind)
                return make_boxed_func(gm.forward)

            return compiler

        self._aot = aot_autograd(fw_compiler=watch("forward"), bw_compiler=watch("backward"))

    def _read(self, gm, kind):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        for node in gm.graph.nodes:
            if node.op == "call_function" and "_local_scalar_dense" in str(node.target):
                self.syncs.append(f"{kind}: {node.target}")
            val = node.meta.get("val")
            if val is not None and free_unbacked_symbols(val):
                self.syncs.append(f"{kind}: {node.target} has a data-dependent size")

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return self._aot(gm, example_inputs)


def _probe_step(model, cfg, probe, ids):
    probe.arm(np.arange(ids.shape[0]) % 3, torch.device("cpu"))
    loss = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1)[:-1], ids.flatten()[1:]) + probe.disarm()
    loss.backward()
    return probe.commit(ONE_PROCESS)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_regional_compile_is_one_graph_for_all_layers_with_the_router_probe_armed_and_no_host_sync(checkpointing):
    """fullgraph=True (maybe_compile's choice for OLMoE): a graph break would raise. Four layers,
    two steps: one compiled frame, shared by every layer, forward and backward free of host syncs;
    the probe records what the eager model routes. Under checkpointing, transformers 5.2x checkpoints
    inside a layer's forward (the compiled graph holds the checkpoint and its recomputation); 5.17, the
    GPU image's, checkpoints around the layer's `__call__`, so the backward's recomputation calls the
    compiled layer again with the probe disarmed: a second forward graph (the disarmed probe's), also
    shared by every layer and compiled once."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    cfg = _cfg(n_layers=4, compile=True, compile_scope="regional", activation_checkpointing=checkpointing)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=32))  # the probe's row length
    domains = ["code", "legal", "prose"]
    torch.manual_seed(0)
    eager = build_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=False)))
    torch.manual_seed(0)
    model = build_model(cfg)
    watch = SyncWatch()
    torch._dynamo.reset()
    maybe_compile(model, cfg, backend=watch)
    probes = [experts.attach(m, cfg, domains) for m in (model, eager)]
    ids = _ids(cfg, sequences=3)
    for _ in range(2):
        figures = [_probe_step(m, cfg, p, ids) for m, p in zip((model, eager), probes)]
    around_call = checkpointing and "__call__" in GradientCheckpointingLayer.__dict__
    assert watch.frames == watch.graphs["forward"] == (2 if around_call else 1)
    assert watch.graphs["backward"] == 1
    assert watch.syncs == []
    assert np.array_equal(probes[0].load.routed, probes[1].load.routed)
    assert probes[0].load.routed.sum() == 2 * 4 * 3 * 32 * cfg.model.moe.experts_per_token
    assert math.isclose(figures[0]["router_aux_loss"], figures[1]["router_aux_loss"], rel_tol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "sync",
    [
        lambda counts: counts.clamp(max=counts.max().item()),  # a scalar read back: .item()
        lambda counts: counts.clamp(max=max(counts.int().tolist())),  # .tolist()
        lambda counts: torch.bincount(counts.long(), minlength=1)[: counts.shape[0]] * 0 + counts,  # bincount
        lambda counts: counts.clamp(max=counts.nonzero().shape[0] + 10**6),  # a data-dependent size
        lambda counts: counts + (1 if counts.sum() > 0 else 0),  # a data-dependent Python branch
    ],
    ids=["item", "tolist", "bincount", "nonzero", "branch"],
)
def test_a_host_sync_in_the_layer_is_caught(monkeypatch, sync):
    """The check the layer passes above catches each kind of host sync: as a refused fullgraph, or
    as a sync in the traced graphs."""
    cfg = _cfg(compile=True, compile_scope="regional")
    real = torch.histc

    def histc_then_sync(*args, **kwargs):
        return sync(real(*args, **kwargs))

    monkeypatch.setattr(moe_layer.torch, "histc", histc_then_sync)
    torch._dynamo.reset()
    torch.manual_seed(0)
    watch = SyncWatch()
    model = maybe_compile(build_model(cfg), cfg, backend=watch)
    try:
        model(input_ids=_ids(cfg)).logits.sum().backward()
    except Exception as err:  # refused by dynamo: a graph break under fullgraph, or a data-dependent guard
        assert "histc_then_sync" in str(err) or "data-dependent" in str(err).lower() or "tolist" in str(err)
    else:
        assert watch.syncs, "the sync went unseen"
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("bf16", [False, True])
def test_the_memory_plan_counts_each_checkpointing_mode_as_the_saved_tensor_probe_measures(bf16):
    """runner.planning.memory.saved_activation_bytes against runner.training.memprobe for the MoE
    model in none, full and selective (bf16: CPU autocast standing in for the GPU's)."""
    from runner.config.schema import ExperimentSchema
    from runner.config.section import from_plain
    from runner.planning.memory import memory_per_device, saved_activation_bytes
    from runner.training.loss import plain_loss_sum
    from runner.training.memprobe import saved_bytes

    micro, seq_len = 2, 64
    plain = {
        "model": {
            "arch": "olmoe",
            "hidden_size": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "intermediate_size": 64,
            "tie_embeddings": True,
            "moe": {"n_experts": 8, "experts_per_token": 2, "expert_intermediate_size": 64},
        },
        "tokenizer": {"vocab_size": 1000, "eos_id": 0},
        "train": {"seq_len": seq_len, "micro_batch_sequences": micro, "global_batch_sequences": micro},
        "hardware": {
            "accelerator": "cuda" if bf16 else "cpu",
            "precision": "bf16" if bf16 else "fp32",
            "memory_gib": 141,
        },
    }
    x, y = torch.randint(0, 1000, (micro, seq_len)), torch.randint(0, 1000, (micro, seq_len))
    measured = {}
    for mode in ("none", "full", "selective"):
        cfg = {**plain, "model": {**plain["model"], "activation_checkpointing": mode}}
        torch.manual_seed(0)
        model = build_model(from_plain(ExperimentSchema, {**cfg, "hardware": {"accelerator": "cpu"}}))
        model.train()

        def forward(model=model):  # the trainer's OLMoE loss: transformers' logits, the runner's plain loss sum
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return plain_loss_sum(model(input_ids=x).logits, y, torch.ones(micro, seq_len, dtype=torch.bool))

        probe = saved_bytes(model, forward)
        planned = saved_activation_bytes(cfg)["total"]
        measured[mode] = probe.activations
        assert abs(planned / probe.activations - 1) <= 0.01, (mode, planned, probe.activations)
        assert memory_per_device(cfg)["activation_checkpointing_mode"] == mode
    assert measured["full"] < measured["selective"] < measured["none"]


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("experiment", ["cpu-tiny-moe-v3", "cpu-tiny-moe-ds"])
def test_the_memory_plan_counts_deepseek_layers_as_built_as_the_saved_tensor_probe_measures(experiment, bf16):
    """saved_activation_bytes against the saved-tensor probe for the DeepSeek-style models, each layer
    as install_deepseek_layers builds it: V3 (a dense first layer, sigmoid router with norm_topk_prob
    and routed scaling, one shared expert, no q/k norms) and V4 (a hash-routed layer, sqrt-softplus
    router, OLMoE's q/k norms, one shared expert, the SwiGLU clip), in none, full and selective."""
    from runner.planning.memory import saved_activation_bytes
    from runner.training.loss import plain_loss_sum
    from runner.training.memprobe import saved_bytes

    micro, seq_len = 2, 64
    base = load_experiment(REPO / f"experiments/{experiment}.yaml", check_files=False).config
    base = dataclasses.replace(
        base, train=dataclasses.replace(base.train, seq_len=seq_len, micro_batch_sequences=micro)
    )
    gpu = dataclasses.replace(base.hardware, accelerator="cuda", precision="bf16") if bf16 else None
    vocab = base.tokenizer.vocab_size
    x, y = torch.randint(0, vocab, (micro, seq_len)), torch.randint(0, vocab, (micro, seq_len))
    for mode in ("none", "full", "selective"):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, activation_checkpointing=mode))
        torch.manual_seed(0)
        model = build_model(cfg).train()

        def forward(model=model):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return plain_loss_sum(model(input_ids=x).logits, y, torch.ones(micro, seq_len, dtype=torch.bool))

        probe = saved_bytes(model, forward)
        planned = saved_activation_bytes(dataclasses.replace(cfg, hardware=gpu) if gpu else cfg)["total"]
        assert abs(planned / probe.activations - 1) <= 0.01, (mode, planned, probe.activations)


def test_activation_checkpointing_modes_load_validate_and_keep_true_and_false_fingerprints(tmp_path):
    from trainfixtures import make_project

    from runner.config.fingerprint import fingerprint
    from runner.errors import RunnerError

    prints = {}
    for value in (True, "full", False, "none", "selective"):
        exp = load_experiment(make_project(tmp_path / str(value), model_extra={"activation_checkpointing": value}))
        assert exp.config.model.activation_checkpointing == value  # recorded as written
        prints[value] = fingerprint(exp.config)
    assert prints[True] == prints["full"] and prints[False] == prints["none"]
    assert len({prints[True], prints[False], prints["selective"]}) == 3
    with pytest.raises(
        RunnerError, match="m.yaml: activation_checkpointing: 'partial' is not one of true, false, full"
    ):
        load_experiment(make_project(tmp_path / "bad", model_extra={"activation_checkpointing": "partial"}))
