"""Export: what a run produced, as a Hugging Face folder the ecosystem loads, verified, with its proof.

Modules: `source` (the run, its verified checkpoint, its weights in transformers' own classes),
`folder` (config.json, generation_config.json, safetensors, tokenizer files), `verify` (the
folder loaded back by transformers alone and compared with the runner's model), `card` (the
model card and accounting.json from the audited report; `card_downstream` its downstream section),
`export` (the whole act, atomic), and `sample` (text from a checkpoint or a folder). Sits above
reports, below the CLI. Never changes a run folder.
"""

#: safetensors shards above this are split (with model.safetensors.index.json): transformers' own
#: default, and what one Hub download handles well. Here, not in runner.export.folder, so that the
#: CLI's help needs no torch.
DEFAULT_MAX_SHARD_SIZE = "5GB"
