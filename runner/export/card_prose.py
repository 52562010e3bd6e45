"""The model card's prose: the sections of the Hub's model card template a stranger reads first.

Owns the words around the figures (runner.export.card owns the figures): a one-paragraph model
description, intended uses and limitations, a usage snippet that runs on the exported folder (a test
runs it), the training data per domain (what it is, its source and licence, tokens seen and epochs),
and the licence of the weights. Everything is rendered from the card's figures (accounting.json) and
the resolved experiment, so the card re-renders identically from what the folder holds. Never reads
the run folder.
"""

from __future__ import annotations

from typing import Any

from runner.config.schema import ExperimentSchema
from runner.mdtext import code, link, text
from runner.planning.flops import params_of_config

#: a prompt per domain the snippet can start from (the first domain found); else PLAIN_PROMPT
PROMPTS = {"code": "def fibonacci(n):", "web": "The history of", "prose": "The"}
PLAIN_PROMPT = "The"
HUB_LICENCES = "https://huggingface.co/docs/hub/repositories-licenses"


def _tokens(n: int) -> str:
    """12,345,678 -> '12.3M'; used in running text (tables carry the exact counts)."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def description(cfg: ExperimentSchema, f: dict) -> list[str]:
    """What the model is, in one paragraph, then the experiment's own note."""
    params = params_of_config(cfg)
    domains = [r["domain"] for r in f["accounting"]]
    exposure = int(f["checkpoint"]["exposure_tokens"])
    arch = {"llama": "Llama-architecture", "olmoe": "OLMoE-architecture mixture-of-experts"}.get(cfg.model.arch)
    return [
        f"A {arch or cfg.model.arch} base language model of {params.all:,} parameters ({cfg.model.n_layers} "
        f"layers, hidden size {cfg.model.hidden_size}, context {cfg.train.seq_len} tokens, a "
        f"{cfg.tokenizer.vocab_size:,}-token vocabulary), pretrained from scratch on {_tokens(exposure)} tokens "
        f"of {', '.join(domains)} (see Training data). It is a base model: no instruction tuning, no "
        "preference tuning, no safety filtering beyond what its data had.",
        "",
        f"Experiment note: {text(cfg.description)}",
    ]


def intended_uses(cfg: ExperimentSchema, f: dict) -> list[str]:
    exposure = int(f["checkpoint"]["exposure_tokens"])
    small = exposure < 1_000_000_000
    lines = [
        "**Intended uses.** Research on pretraining: reproducing, auditing or comparing this experiment "
        "(its data, accounting and cost are on this card and re-checkable with the `runner` that made it), "
        "a baseline or starting point for further training, and tests of tooling that loads causal LMs.",
        "",
        "**Limitations.** ",
    ]
    limits = [
        f"It has seen {_tokens(exposure)} tokens"
        + (", far too few for fluent or factual text: expect repetitive, often meaningless output" if small else ""),
        f"it knows only its training domains ({', '.join(r['domain'] for r in f['accounting'])}) and "
        f"their languages, within a {cfg.train.seq_len}-token context",
        "its outputs are not checked for truth, safety or bias, so it is not for answering questions, "
        "giving advice or producing text people will rely on",
    ]
    lines[-1] += "; ".join(limits) + "."
    return lines


def usage_snippet(f: dict) -> list[str]:
    """Python that loads the folder with transformers alone and generates greedily (a test runs it)."""
    domains = [r["domain"] for r in f["accounting"]]
    prompt = next((PROMPTS[d] for d in domains if d in PROMPTS), PLAIN_PROMPT)
    return [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'path = "."  # this folder, or the Hub repository it was pushed to',
        "tokenizer = AutoTokenizer.from_pretrained(path)",
        "model = AutoModelForCausalLM.from_pretrained(path)",
        f'inputs = tokenizer({prompt!r}, return_tensors="pt")',
        "out = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
        f"The `runner` that trained it samples it the same way: `runner sample . --prompt {prompt!r}` (greedy "
        "unless `--temperature`).",
    ]


def _cell(x: Any) -> str:
    """A table cell of text already escaped (runner.mdtext: its pipes too), or '-'."""
    return "-" if x is None or x == "" else str(x)


def training_data(f: dict) -> list[str]:
    """Each domain: what it is, its source and licence (its data card), tokens seen and epochs."""
    by_domain = {r["domain"]: r for r in f["accounting"]}
    lines = [
        "| domain | what it is | source | licence | tokens seen | epochs |",
        "|---|---|---|---|---|---|",
    ]
    for d in f.get("data") or []:
        row = by_domain.get(d["domain"], {})
        source = link(d["source"], d.get("source_url")) if d.get("source") else None
        if source and d.get("revision"):
            rev = str(d["revision"])
            source += f" at {code(rev, in_table=True)}"
        licence = link(d["licence"], d.get("licence_url")) if d.get("licence") else None
        seen = row.get("exposure_tokens")
        epochs = row.get("epochs")
        lines.append(
            f"| {text(d['domain'])} | {_cell(text(d.get('description') or 'not described (no datacard.json beside its manifest)'))} "
            f"| {_cell(source)} | {_cell(licence)} | {'-' if seen is None else f'{int(seen):,}'} "
            f"| {'-' if epochs is None else f'{float(epochs):.3g}'} |"
        )
    return lines


def licence(cfg: ExperimentSchema, f: dict) -> list[str]:
    chosen = cfg.export.license
    data = sorted({text(d.get("licence")) for d in (f.get("data") or []) if d.get("licence")})
    terms = f" The training data's licences: {'; '.join(data)} (Training data above)." if data else ""
    if chosen:
        return [f"The weights are released under `{chosen}` (the Hub's licence ids: {HUB_LICENCES}).{terms}"]
    return [
        "No licence was chosen for these weights (`license: other` above): the experiment's `export.license` "
        f"is unset, so no use is granted beyond what the law allows without one. Set it to a Hub licence id "
        f"({HUB_LICENCES}) and export again to grant one.{terms}"
    ]
