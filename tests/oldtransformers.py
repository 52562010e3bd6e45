"""transformers 4.57 in an environment of its own, for tests that load an exported folder the way
an older consumer does (no runner import, the newest 4.x reader).

Built once with pip into a cache folder (`RUNNER_TF457_DIR`, default ~/.cache/runner-ci/tf457):
transformers 4.57.6 with the huggingface_hub and tokenizers releases it requires, nothing else
(torch, numpy, safetensors and the rest are this interpreter's). A process sees it through
PYTHONPATH alone. Built in a temporary folder and renamed into place, so parallel workers agree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from timeouts import SUBPROCESS_TIMEOUT_S

PINS = ("transformers==4.57.6", "huggingface_hub>=0.34,<1.0", "tokenizers>=0.22,<0.23")
TF457 = Path(os.environ.get("RUNNER_TF457_DIR") or Path.home() / ".cache" / "runner-ci" / "tf457")
MARKER = ".complete"


def tf457_dir() -> Path:
    """The cached environment, built first if it is not there (needs PyPI once)."""
    if (TF457 / MARKER).exists():
        return TF457
    tmp = TF457.with_name(f"{TF457.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp), *PINS],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"cannot build the transformers 4.57 environment ({' '.join(PINS)}):\n{proc.stderr[-2000:]}"
        )
    (tmp / MARKER).write_text(" ".join(PINS) + "\n")
    if TF457.exists() and not (TF457 / MARKER).exists():
        shutil.rmtree(TF457, ignore_errors=True)  # an unfinished build
    try:
        os.rename(tmp, TF457)
    except OSError:  # another worker moved its finished copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return TF457


CONSUMER = r"""
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
assert not any(m == "runner" or m.startswith("runner.") for m in sys.modules), "runner imported"
out = []
for folder, ids, prompt in json.loads(sys.argv[1]):
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits
    generate = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    text = generate(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    out.append({"version": transformers.__version__, "class": type(model).__name__,
                "logits": logits.tolist(), "text": text, "prompt_ids": tok(prompt)["input_ids"]})
print(json.dumps(out))
"""


def consume(jobs: list[tuple[Path, list[list[int]], str]]) -> list[dict]:
    """What transformers 4.57 makes of each (folder, ids, prompt), in one process: the model's class,
    its logits on `ids`, the greedy text of pipeline("text-generation") after `prompt`."""
    import json

    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(PYTHONPATH=str(tf457_dir()), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", CONSUMER, json.dumps([[str(f), ids, prompt] for f, ids, prompt in jobs])],
        capture_output=True,
        text=True,
        env=environ,
        cwd=jobs[0][0],
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
