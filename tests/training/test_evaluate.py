"""Evaluation of a compiled model (per-domain validation, downstream scoring) runs eager, and so
triggers no compilation."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from trainfixtures import make_project

from runner.config.eval_recipe import DownstreamTask
from runner.config.load import load_experiment
from runner.training import evaluate
from runner.training.batches import load_data
from runner.training.downstream.run import prepare, score
from runner.training.model import build_model, maybe_compile


@pytest.mark.slow  # dynamo traces the model: ~10 s on a loaded core
def test_evaluation_after_compiled_training_compiles_nothing(tmp_path):
    exp = load_experiment(make_project(tmp_path, model_extra={"compile": True}))
    cfg = exp.config
    data = load_data(exp, cfg.train.seq_len)
    torch.manual_seed(0)
    model = build_model(cfg)
    eager_rows = evaluate.evaluate(model, data, _CPU, 3, 0, 0)
    counter, compiled = _compiled_and_trained(model, cfg)
    # 8 validation samples per domain in micro batches of 3: sizes 3, 3, 2 (new shapes), in eval mode
    rows = evaluate.evaluate(model, data, _CPU, 3, 1, 0)
    assert counter.frame_count == compiled
    assert model.training
    assert [r["loss_nats"] for r in rows] == [r["loss_nats"] for r in eager_rows]


@pytest.mark.slow  # dynamo traces the model: ~10 s on a loaded core
@pytest.mark.parametrize("scope", ["model", "regional"])
def test_downstream_scoring_after_compiled_training_compiles_nothing(tmp_path, scope):
    """The loop's scoring call on the compiled model: no graph is traced for eval mode, the packed
    rows' 4D mask or the head on the scored positions, and every request's ll is the eager model's."""
    exp = load_experiment(make_project(tmp_path, seq_len=64, model_extra={"compile": True, "compile_scope": scope}))
    cfg = exp.config
    prepared = prepare(exp, {"builtin": DownstreamTask(format="builtin", limit=6)})
    torch.manual_seed(0)
    model = build_model(cfg)
    eager = score(model, prepared, step=0, exposure_tokens=0, micro_batch=4, dtype="float32")
    counter, compiled = _compiled_and_trained(model, cfg)
    scored = score(model, prepared, step=1, exposure_tokens=0, micro_batch=4, dtype="float32")
    assert counter.frame_count == compiled
    assert model.training
    assert [r["ll"] for r in scored.requests] == [r["ll"] for r in eager.requests]


def _compiled_and_trained(model, cfg):
    """The model compiled in place as the recipe says and one training step run: the graph counter
    (a torch.compile backend that counts the graphs dynamo hands it) and the graphs it holds."""
    counter = CompileCounter()
    maybe_compile(model, cfg, backend=counter)
    model.train()
    x = torch.randint(1, 4096, (cfg.train.micro_batch_sequences, cfg.train.seq_len))
    model(input_ids=x, loss_targets=x, loss_mask=torch.ones_like(x, dtype=torch.bool)).backward()
    assert counter.frame_count >= 1
    return counter, counter.frame_count


_CPU = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"), autocast=contextlib.nullcontext)
