"""A grid of pilot experiments for a scaling fit: model sizes x exposure budgets.

Owns: turning one experiment into size x budget experiment files that keep the tokenizer,
mixture, eval, optimizer, hardware, sequence length and global batch fixed and change only the
model and the budget (each rounded down to whole global batches, the rounding stated), plus a
README.md saying what is fixed and why.
Never: launches runs, or edits the base experiment or any recipe.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runner.config.load import RECIPE_NAME, Experiment
from runner.config.schema import ModelRecipe
from runner.data.manifest import load_experiment_manifests, plan_experiment_mixture
from runner.errors import MixtureInfeasible, RunnerError
from runner.fsio import read_yaml
from runner.planning.flops import params_of_config
from runner.planning.resources import load_experiment, load_experiment_data
from runner.planning.token_counts import token_count

SIZE_KEYS = ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size")


def parse_tokens(text: str) -> int:
    """`300K`, `2.5M`, `1B`, `1e9`, `1_000_000` -> an integer token count (runner.planning.token_counts)."""
    value = token_count(text)
    if value is None:
        raise RunnerError(f"budget {text!r} is not a token count like 300K, 2.5M, 1B or 1e9", key="--budgets")
    if value <= 0:
        raise RunnerError(f"budget {text!r} must be positive", key="--budgets")
    return int(value)


def _token_label(tokens: int) -> str:
    for factor, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if tokens >= factor:
            return f"{tokens / factor:.3g}{suffix}".replace(".", "p")
    return str(tokens)


@dataclass(frozen=True)
class Size:
    """A model size: a model recipe reference, or overrides of the base model's shape."""

    label: str
    recipe: str | None = None
    overrides: tuple[tuple[str, int], ...] = ()


def parse_size(text: str) -> Size:
    """`llama-tiny@1` (a model recipe) or `hidden_size=128+n_layers=4` (shape overrides)."""
    text = text.strip()
    if "=" not in text:
        name, _, version = text.partition("@")
        if not (RECIPE_NAME.fullmatch(name) and version.isdigit()):
            raise RunnerError(f"size {text!r} is neither NAME@VERSION nor key=value[+key=value]", key="--sizes")
        return Size(label=text.split("@")[0], recipe=text)
    pairs: list[tuple[str, int]] = []
    for part in text.split("+"):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in SIZE_KEYS:
            raise RunnerError(f"size {text!r}: {key!r} is not one of {', '.join(SIZE_KEYS)}", key="--sizes")
        if not value.strip().isdigit() or int(value) <= 0:
            raise RunnerError(f"size {text!r}: {key} must be a positive integer", key="--sizes")
        if key in dict(pairs):  # `hidden_size=128+hidden_size=64` was a model of hidden size 64 named h128-h64
            raise RunnerError(f"size {text!r}: {key} is given twice: give it once", key="--sizes")
        pairs.append((key, int(value)))
    short = {"hidden_size": "h", "n_layers": "l", "n_heads": "a", "n_kv_heads": "kv", "intermediate_size": "f"}
    return Size(label="-".join(f"{short[k]}{v}" for k, v in pairs), overrides=tuple(pairs))


def llama_intermediate_size(hidden_size: int, multiple: int = 16) -> int:
    """SwiGLU width of Llama: 8/3 of the hidden size (same FLOPs as a 4x GELU MLP), rounded up."""
    return -(-(8 * hidden_size // 3) // multiple) * multiple


def size_overrides(size: Size, base_model: ModelRecipe) -> dict[str, int]:
    """The model keys a shape-override size writes, filling the ones its change implies."""
    o = dict(size.overrides)
    if "hidden_size" in o:
        if "intermediate_size" not in o:
            o["intermediate_size"] = llama_intermediate_size(o["hidden_size"])
        if o["hidden_size"] % o.get("n_heads", base_model.n_heads):
            raise RunnerError(
                f"size {size.label}: hidden_size {o['hidden_size']} is not divisible by n_heads "
                f"{o.get('n_heads', base_model.n_heads)}; give n_heads too",
                key="--sizes",
            )
    heads = o.get("n_heads", base_model.n_heads)
    if heads % o.get("n_kv_heads", base_model.n_kv_heads):
        raise RunnerError(
            f"size {size.label}: n_heads {heads} is not divisible by n_kv_heads; give n_kv_heads", key="--sizes"
        )
    return o


def round_budget(tokens: int, global_batch_tokens: int) -> int:
    """Whole global batches only (SPEC: a budget is a whole number of global batches)."""
    return tokens // global_batch_tokens * global_batch_tokens


def _pilot_doc(raw: dict, size: Size, model_keys: dict[str, int], budget: int, tokens: int, by_reference: bool) -> dict:
    """One pilot experiment file: the base (by reference or copied), the size's model, the budget."""
    name = f"{raw['name']}-pilot-{size.label}-{_token_label(budget)}"
    doc: dict[str, Any] = {"name": name, "version": 1}
    rounding = "" if budget == tokens else f" (requested {tokens:,}, rounded down to whole global batches)"
    doc["description"] = (
        f"Pilot of {raw['name']}@{raw['version']}: model {size.recipe or size.label}, "
        f"{budget:,} exposure tokens{rounding}."
    )
    if by_reference:
        doc["base"] = f"{raw['name']}@{raw['version']}"
    else:
        doc.update({k: v for k, v in raw.items() if k not in ("name", "version", "description")})
    if size.recipe:
        doc["recipes"] = {**(doc.get("recipes") or {}), "model": size.recipe}
    else:
        overrides = dict(doc.get("overrides") or {})
        overrides["model"] = {**(overrides.get("model") or {}), **model_keys}
        doc["overrides"] = overrides
    # The schedule spans the pilot's own budget (Hoffmann et al. 2022: a cosine longer than
    # the run overestimates the loss), so max duration = exposure, and no early stop.
    doc["train"] = {
        **(doc.get("train") or {}),
        "exposure_tokens": budget,
        "max_duration_tokens": budget,
        "hard_stop_tokens": None,
    }
    return doc


def _rounded_budgets(base: Experiment, budgets: Sequence[str], requested: list[int]) -> list[int]:
    """Each budget rounded down to whole global batches; refused when nothing or only warm-up is left."""
    train = base.config.train
    batch_tokens = train.global_batch_sequences * train.seq_len
    warmup = base.config.optim.warmup_tokens
    rounded = []
    for text, tokens in zip(budgets, requested):
        r = round_budget(tokens, batch_tokens)
        if r == 0:
            raise RunnerError(f"budget {text} is less than one global batch ({batch_tokens:,} tokens)", key="--budgets")
        if r <= warmup:
            raise RunnerError(
                f"budget {text} ({r:,} tokens) is not longer than optim.warmup_tokens "
                f"({warmup:,}): the schedule would never leave warm-up",
                key="--budgets",
            )
        rounded.append(r)
    return rounded


def write_pilot_grid(
    base_path: str | Path, sizes: Sequence[str], budgets: Sequence[str], out_dir: str | Path
) -> list[Path]:
    """Write one experiment YAML per (size, budget) and a README.md; return the files written.

    Every pilot is resolved by the loader, as `runner launch` will resolve it, before any file is
    written."""
    base_path = Path(base_path)
    if not base_path.exists():
        raise RunnerError("experiment not found", file=str(base_path))
    raw = read_yaml(base_path)
    if not isinstance(raw, dict) or "name" not in raw or "version" not in raw:
        raise RunnerError("not an experiment file (needs name and version)", file=str(base_path))
    base = load_experiment(base_path, check_files=False)
    root = base.project_root
    _refuse_repeats("--sizes", sizes)
    _refuse_repeats("--budgets", budgets)
    parsed_sizes = [parse_size(s) for s in sizes]
    requested = [parse_tokens(b) for b in budgets]
    if not parsed_sizes or not requested:
        raise RunnerError("give at least one size and one budget", key="--sizes")
    rounded = _rounded_budgets(base, budgets, requested)
    _check_budgets_feasible(base, dict(zip(budgets, rounded)))

    # Base by reference when the loader can find it (experiments/NAME.yaml); otherwise a full copy.
    by_reference = (root / "experiments" / f"{raw['name']}.yaml").resolve() == base_path.resolve()
    out_dir = Path(out_dir)
    pilots = []  # every pilot is resolved before any file is written
    made: dict[object, tuple[str, str]] = {}  # a pilot's file and its model + budget -> the entries giving it
    for size_text, size in zip(sizes, parsed_sizes):
        model_keys = size_overrides(size, base.config.model) if not size.recipe else {}
        for text, tokens, budget in zip(budgets, requested, rounded):
            doc = _pilot_doc(raw, size, model_keys, budget, tokens, by_reference)
            path = out_dir / f"{doc['name']}.yaml"
            pilot = _resolve_pilot(doc, path, root, size)
            _refuse_twice(made, path, (_model_shape(pilot), budget), size_text, text)
            pilots.append((path, doc, size, pilot, text, tokens, budget))
    readme = out_dir / "README.md"
    _refuse_foreign_files([(p, f"{WRITTEN_BY} from ") for p, *_ in pilots] + [(readme, README_TITLE)])
    out_dir.mkdir(parents=True, exist_ok=True)
    written, rows = [], []
    for path, doc, size, pilot, text, tokens, budget in pilots:
        path.write_text(
            f"{WRITTEN_BY} from {base_path.name}\n" + yaml.safe_dump(doc, sort_keys=False),
            encoding="utf-8",
        )
        written.append(path)
        params = params_of_config(pilot.config).non_embedding
        rows.append((path.name, size.recipe or size.label, params, text, tokens, budget))
    batch_tokens = base.config.train.global_batch_sequences * base.config.train.seq_len
    readme.write_text(_readme(raw, base, rows, batch_tokens, by_reference, base_path), encoding="utf-8")
    return written + [readme]


def _refuse_twice(made: dict, path: Path, point: tuple, size: str, budget: str) -> None:
    """One pilot per point and one file per pilot: `--budgets 1e5,99000` (both 48 batches of 2,048)
    listed one pilot twice in README.md, and `--budgets 1001472,1003520` (both "1M") wrote one file
    twice, the second over the first."""
    for key in (("point", point), ("file", path.name)):
        if key in made:
            size0, budget0 = made[key]
            flag, first, second = ("--sizes", size0, size) if size0 != size else ("--budgets", budget0, budget)
            if key[0] == "file":  # 1,001,472 and 1,003,520 tokens are both "1M"
                why = f"would both be written to {path.name}: give budgets or sizes that differ in their names"
            elif flag == "--budgets":
                why = f"are the same pilot: both round to {point[1]:,} tokens (whole global batches)"
            else:
                why = "are the same pilot (one model shape)"
            raise RunnerError(f"{first!r} and {second!r} {why}", key=flag)
        made[key] = (size, budget)


def _model_shape(pilot: Experiment) -> str:
    """The pilot's resolved model, whatever named it: `n_layers=2` and `n_layers=2+n_heads=4` (the base's
    n_heads), or `llama-tiny@1` and `hidden_size=64` on a llama-tiny base, are one model, one pilot."""
    model = {k: v for k, v in pilot.to_container()["model"].items() if k not in ("name", "version", "description")}
    return json.dumps(model, sort_keys=True, default=str)


def _refuse_repeats(flag: str, texts: Sequence[str]) -> None:
    """`--sizes h64,h64`: each entry once."""
    seen = set()
    for text in texts:
        if text.strip() in seen:
            raise RunnerError(f"{text.strip()!r} is given twice: give each once", key=flag)
        seen.add(text.strip())


def _resolve_pilot(doc: dict, path: Path, root: Path, size: Size) -> Experiment:
    """The pilot as the loader resolves it; a size whose model recipe is missing names --sizes."""
    if size.recipe:
        name, version = size.recipe.split("@")
        recipe = root / "recipes" / "model" / f"{name}.yaml"
        if not recipe.exists():
            raise RunnerError(f"no model recipe {name!r} in recipes/model/", key="--sizes")
        model = read_yaml(recipe)
        found = model.get("version") if isinstance(model, dict) else None
        if found != int(version):
            raise RunnerError(f"names {size.recipe} but {recipe.name} is version {found}", key="--sizes")
    return load_experiment_data(doc, path, root, check_files=False)


WRITTEN_BY = "# written by `runner pilot-grid`"
README_TITLE = "# Pilot grid of "


def _refuse_foreign_files(files: list[tuple[Path, str]]) -> None:
    """A pilot YAML or README.md already at --out is rewritten only when an earlier pilot-grid wrote it
    (its first line says so): `--out .` rewrote the project's README.md."""
    for path, head in files:
        if path.exists() and not (path.is_file() and path.read_text(errors="replace").startswith(head)):
            raise RunnerError(
                f"{path} is there and was not written by `runner pilot-grid`: give another --out", key="--out"
            )


def _readme(raw: dict, base: Experiment, rows: list, batch_tokens: int, by_reference: bool, base_path: Path) -> str:
    cfg = base.config
    t, r = cfg.train, cfg.recipes
    lines = [
        f"{README_TITLE}{raw['name']}@{raw['version']}",
        "",
        "Written by `runner pilot-grid`. The pilots are the points of a scaling fit",
        "(`runner fit RUN...`), so everything but the model size and the budget stays fixed:",
        "",
        f"- tokenizer `{r.get('tokenizer')}`, mixture `{r.get('mixture')}`, eval `{r.get('eval')}`: the loss must be",
        "  measured on the same data, with the same tokens, on the same held-out samples at every point;",
        f"- global batch {t.global_batch_sequences} sequences x seq_len {t.seq_len} = {batch_tokens:,} tokens,",
        f"  optimizer `{r.get('optim')}`, hardware `{r.get('hardware')}`, seed {cfg.seed}: a change of",
        "  batch or learning rate between points would be fitted as a change of N or D;",
        "- each pilot's learning-rate schedule spans its own budget (`max_duration_tokens` = `exposure_tokens`),",
        "  as Hoffmann et al. 2022 do: a schedule longer than the run leaves the loss too high.",
        "",
        "The base experiment is referenced (`base:`), so its later versions do not leak in."
        if by_reference
        else f"The base experiment ({base_path}) is copied into each file.",
        "",
        "Budgets are exposure tokens rounded DOWN to whole global batches (a budget must be a whole",
        "number of global batches):",
        "",
        "| file | model | non-embedding params | requested | rounded to | steps | tokens dropped |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for file, model, params, text, tokens, budget in rows:
        lines.append(
            f"| {file} | {model} | {params:,} | {text} ({tokens:,}) | {budget:,} | "
            f"{budget // batch_tokens:,} | {tokens - budget:,} |"
        )
    if (raw.get("overrides") or {}).get("model"):
        lines += ["", f"Note: the base's `overrides.model` ({raw['overrides']['model']}) applies to every pilot."]
    lines += [
        "",
        "Shape overrides that change hidden_size without intermediate_size get Llama's SwiGLU width,",
        "8/3 x hidden_size rounded up to a multiple of 16.",
        "Check each pilot with `runner plan` before launching (memory, mixture feasibility, time).",
        "",
    ]
    return "\n".join(lines)


def _check_budgets_feasible(base: Experiment, budgets: dict[str, int]) -> None:
    """With the manifests on disk, refuse a budget the mixture cannot meet under its repetition caps."""
    manifests, _ = load_experiment_manifests(base, missing_ok=True)
    if len(manifests) != len(base.config.mixture.domains):
        return
    for text, tokens in budgets.items():
        try:
            plan_experiment_mixture(base, manifests, tokens)
        except MixtureInfeasible as e:
            raise RunnerError(f"budget {text} ({tokens:,} tokens): {e}", key="--budgets") from None
