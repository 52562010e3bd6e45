"""Downstream tasks (SPEC "Downstream evaluation"): pinned task files in three formats, the fixed
subset, HFLM's encode/pair/window rules, batched scoring and the metrics; and the reference test
against lm-evaluation-harness 0.4.13's HFLM on a saved transformers folder."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from runner.config.eval_recipe import DownstreamTask
from runner.data.builtin.build import TOKENIZER_PATH
from runner.data.tokenizer import load_tokenizer, vocab_size_of
from runner.errors import Problems, RunnerError
from runner.fsio import sha256_file
from runner.training.downstream.builtin_task import _held_out_texts, builtin_documents
from runner.training.downstream.documents import Document, Request, Task
from runner.training.downstream.encode import Encoder, bos_id_of
from runner.training.downstream.metrics import aggregate, task_metrics
from runner.training.downstream.score import batches, loglikelihoods
from runner.training.downstream.tasks import load_task, subset

REPO = Path(__file__).resolve().parents[2]
OLMES = REPO / "tests/assets/downstream/olmes"
SEQ_LEN = 64


def olmes_spec(name: str, limit: int | None = None) -> DownstreamTask:
    folder = OLMES / name
    return DownstreamTask(
        format="olmes",
        path=str(folder / "requests.jsonl.gz"),
        sha256=sha256_file(folder / "requests.jsonl.gz"),
        config_path=str(folder / "config.json"),
        config_sha256=sha256_file(folder / "config.json"),
        limit=limit,
        metrics=["acc", "acc_norm", "acc_per_char", "centered_acc"],
    )


def olmes_task(name: str, limit: int | None = None) -> Task:
    return load_task(name, olmes_spec(name, limit), REPO)


def builtin_task(limit: int | None = 12) -> Task:
    return load_task("builtin", DownstreamTask(format="builtin", limit=limit, metrics=["acc", "bpb"]), REPO)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER_PATH)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, as the runner's in-process launches use: on a shared 2-core machine two
    spinning threads make a tiny model's forward ~30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tokenizer, one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size_of(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    return LlamaForCausalLM(config).eval()


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sha256_file(path)


# --- task files ------------------------------------------------------------------------------


def test_olmes_task_drops_unconditional_rows_and_groups_choices():
    rows = [json.loads(line) for line in gzip.open(OLMES / "arc_easy_rc_5shot/requests.jsonl.gz", "rt")]
    task = olmes_task("arc_easy_rc_5shot")
    assert len(rows) == 96 and sum(r["doc_id"] >= 1_000_000 for r in rows) == 48
    assert task.total_documents == 12 and [d.doc_id for d in task.documents] == list(range(12))
    first = task.documents[0]
    doc_rows = sorted((r for r in rows if r["doc_id"] == 0), key=lambda r: r["idx"])
    assert first.gold == doc_rows[0]["label"] == doc_rows[0]["doc"]["gold"]
    assert [r.continuation for r in first.requests] == [r["request"]["continuation"] for r in doc_rows]
    assert all(r.context == doc_rows[0]["request"]["context"] for r in first.requests)
    assert first.requests[0].context.count("Question:") == 6  # 5 shots rendered into the context


def test_task_file_whose_sha256_differs_is_refused(tmp_path):
    spec = olmes_spec("piqa_rc_0shot")
    bad = DownstreamTask(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(RunnerError, match=r"requests.jsonl.gz: eval.tasks.piqa.sha256: file sha256 is [0-9a-f]{64}"):
        load_task("piqa", bad, REPO)
    missing = DownstreamTask(**{**spec.__dict__, "path": str(tmp_path / "nope.jsonl.gz")})
    with pytest.raises(RunnerError, match="task file not found"):
        load_task("piqa", missing, REPO)


def test_mc_and_schema_jsonl(tmp_path):
    mc = tmp_path / "mc.jsonl"
    sha = _write_jsonl(
        mc,
        [
            {"query": "Q: 2+2?\nA:", "choices": ["4", "5"], "gold": 0},
            {"query": "x", "choices": ["a", "b", "c"], "gold": 2},
        ],
    )
    task = load_task("mc", DownstreamTask(format="mc", path=str(mc), sha256=sha), tmp_path)
    assert [d.gold for d in task.documents] == [0, 2]
    assert task.documents[0].requests == (Request("Q: 2+2?\nA:", " 4"), Request("Q: 2+2?\nA:", " 5"))
    schema = tmp_path / "schema.jsonl"
    sha = _write_jsonl(schema, [{"context_options": ["The cat", "The dog"], "continuation": "barked.", "gold": 1}])
    task = load_task("wg", DownstreamTask(format="schema", path=str(schema), sha256=sha), tmp_path)
    assert task.documents[0].requests == (Request("The cat", " barked."), Request("The dog", " barked."))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"query": "q", "choices": ["a", "b"], "gold": 2}, "document 0: gold must be an index below 2"),
        ({"query": "q", "choices": ["a"], "gold": 0}, "choices must be a list of at least two strings"),
        ({"choices": ["a", "b"], "gold": 0}, "query must be a string"),
    ],
)
def test_malformed_mc_rows_are_refused_naming_the_file(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    sha = _write_jsonl(path, [row])
    with pytest.raises(RunnerError, match=message) as e:
        load_task("bad", DownstreamTask(format="mc", path=str(path), sha256=sha), tmp_path)
    assert "bad.jsonl" in str(e.value)


_MC_ROW = json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0}) + "\n"


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        pytest.param(
            "cut.jsonl.gz",
            gzip.compress(_MC_ROW.encode() * 50)[:-10],
            "not a whole readable gzip file (EOFError",
            id="cut.jsonl.gz",
        ),
        pytest.param(
            "plain.jsonl.gz", _MC_ROW.encode(), "not a whole readable gzip file (BadGzipFile", id="plain.jsonl.gz"
        ),
        pytest.param(
            "latin1.jsonl",
            b'{"query": "\xff", "choices": ["a", "b"], "gold": 0}\n',
            "not UTF-8 text",
            id="latin1.jsonl",
        ),
        pytest.param(
            "digits.jsonl",
            b'{"query": "q", "choices": ["a", "b"], "gold": ' + b"1" * 5000 + b"}\n",
            "ValueError",
            id="digits.jsonl",
        ),
        pytest.param(
            "deep.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1 is refused: RecursionError", id="deep.jsonl"
        ),
        pytest.param(
            "surrogate.jsonl",
            b'{"query": "q\\ud800", "choices": ["a", "b"], "gold": 0}\n',
            "lone surrogate",
            id="surrogate.jsonl",
        ),
    ],
)
def test_a_task_file_unreadable_as_its_format_is_one_line_naming_it_and_the_task(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    spec = DownstreamTask(format="mc", path=str(path), sha256=sha256_file(path))
    with pytest.raises(RunnerError) as e:
        load_task("t", spec, tmp_path)
    assert f"{name}: eval.tasks.t: " in str(e.value) and message in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_an_olmes_config_unreadable_as_json_is_one_line_naming_it(tmp_path):
    spec = olmes_spec("piqa_rc_0shot")
    for i, text in enumerate((b"[" * 100_000, b"\xff", b"[1, 2]", b'{"metric_kwargs": {"uncond_docid_offset": true}}')):
        config = tmp_path / f"config{i}.json"
        config.write_bytes(text)
        bad = DownstreamTask(**{**spec.__dict__, "config_path": str(config), "config_sha256": sha256_file(config)})
        with pytest.raises(RunnerError, match=rf"config{i}.json: eval.tasks.piqa: ") as e:
            load_task("piqa", bad, REPO)
        assert len(str(e.value).splitlines()) == 1


def test_task_section_validation():
    problems = Problems()
    DownstreamTask(format="mc", limit=0, metrics=["accuracy"], random_baseline=1.0).validate(
        problems, "eval.yaml", "tasks.t"
    )
    text = "\n".join(problems.lines)
    for expected in (
        "tasks.t.path",
        "tasks.t.sha256",
        "tasks.t.limit",
        "tasks.t.metrics[0]",
        "tasks.t.random_baseline",
    ):
        assert expected in text
    problems = Problems()
    DownstreamTask(format="builtin").validate(problems, "eval.yaml", "tasks.b")
    assert problems.lines == []
    DownstreamTask(format="builtin", metrics=["acc", "bpb", "acc"]).validate(problems, "eval.yaml", "tasks.b")
    assert problems.lines == [
        "eval.yaml: tasks.b.metrics[2]: 'acc' is listed twice (metrics[0]): a figure is recorded once"
    ]


def test_subset_is_the_first_limit_of_the_seeded_permutation_in_id_order():
    docs = [Document(i, 0, (Request("a", " b"), Request("a", " c"))) for i in (5, 3, 9, 1, 7, 2)]
    chosen = subset(docs, 3, seed=7)
    by_id = sorted(d.doc_id for d in docs)
    expected = sorted(by_id[i] for i in np.random.default_rng(7).permutation(6)[:3])
    assert [d.doc_id for d in chosen] == expected
    assert [d.doc_id for d in subset(list(reversed(docs)), 3, seed=7)] == expected  # file order does not matter
    assert [d.doc_id for d in subset(docs, None, 0)] == by_id == [d.doc_id for d in subset(docs, 10, 0)]


def test_builtin_task_is_deterministic_and_gold_is_the_true_context():
    docs, sha = builtin_documents()
    builtin_documents.cache_clear()
    again, sha2 = builtin_documents()
    assert sha == sha2 and docs == again and len(docs) >= 100
    texts = [" ".join(t.split()) for _, t in _held_out_texts()]
    for d in docs[:: max(1, len(docs) // 20)]:
        context, continuation = d.requests[d.gold].context, d.requests[d.gold].continuation
        source = [t for t in texts if context + continuation in t]
        assert len(source) == 1, "the continuation follows the gold context in one held-out document"
        assert {r.continuation for r in d.requests} == {continuation}  # every choice scores the same string
        for j, r in enumerate(d.requests):
            if j != d.gold:
                assert r.context not in source[0] and r.context + continuation not in source[0]
    assert {d.gold for d in docs} == {0, 1, 2, 3}


# --- encoding (HFLM's rules) -----------------------------------------------------------------


def test_pair_moves_trailing_whitespace_and_splits_the_whole_encoding(tokenizer):
    enc = Encoder(tokenizer, SEQ_LEN)
    c, k = enc.pair("The answer is ", "yes")
    assert c == tokenizer.encode("The answer is").ids
    assert c + k == tokenizer.encode("The answer is yes").ids
    assert tokenizer.decode(k) == " yes"


def test_empty_context_uses_eos_without_bos_and_bos_with_a_template(tokenizer):
    enc = Encoder(tokenizer, SEQ_LEN)
    assert enc.bos is None and enc.prefix == tokenizer.token_to_id("<|endoftext|>")
    assert enc.pair("", " hello") == ([enc.prefix], tokenizer.encode(" hello").ids)
    assert enc.pair("", "<|endoftext|> hi")[0] == [enc.prefix]  # split as text: no special token
    vocab = {"<s>": 0, "</s>": 1, "<|endoftext|>": 2, "a": 3, "b": 4}
    templated = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    templated.pre_tokenizer = pre_tokenizers.Whitespace()
    templated.add_special_tokens(["<s>", "</s>", "<|endoftext|>"])
    templated.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert bos_id_of(templated) == 0
    enc = Encoder(templated, SEQ_LEN)
    assert enc.prefix == 0 and enc.pair("", "b a") == ([0], [4, 3])
    assert enc.pair("a", " b") == ([0, 3], [4])  # the template's BOS heads the context


def test_window_keeps_the_last_seq_len_plus_one_tokens(tokenizer):
    enc = Encoder(tokenizer, 8)
    c, k = enc.pair("one two three four five six seven eight nine ten", " eleven")
    e = enc.window("one two three four five six seven eight nine ten", " eleven")
    assert len(e.inputs) == 8 and e.inputs == tuple((c + k)[-9:-1]) and e.targets == tuple(k)


def test_refusals_when_a_task_is_loaded(tokenizer):
    def task_of(context: str, continuation: str) -> Task:
        docs = (Document(0, 0, (Request(context, continuation), Request("ok", " fine"))),)
        return Task("t", "mc", "0" * 64, None, docs, 1, None, 0, ("acc",), None, " ", "t.jsonl")

    enc = Encoder(tokenizer, 4)
    with pytest.raises(RunnerError, match="t.jsonl: task t: document 0 choice 0: the context is whitespace only"):
        enc.encode_task(task_of("  ", " x"))
    with pytest.raises(RunnerError, match="encodes to no token"):
        enc.encode_task(task_of("context", ""))
    with pytest.raises(RunnerError, match="above seq_len 4"):
        enc.encode_task(task_of("context", " a long continuation of many many words"))


# --- scoring and metrics ---------------------------------------------------------------------


def _one_at_a_time(model, encoded) -> list[float]:
    out = []
    with torch.no_grad():
        for e in encoded:
            logp = model(input_ids=torch.tensor([e.inputs])).logits[0].float().log_softmax(-1)
            n = len(e.targets)
            out.append(float(logp[-n:].gather(1, torch.tensor(e.targets)[:, None]).sum()))
    return out


def test_batched_scoring_equals_one_request_per_forward(tokenizer, tiny_model):
    task = olmes_task("piqa_rc_0shot", limit=3)
    encoded = Encoder(tokenizer, SEQ_LEN).encode_task(task)
    alone = _one_at_a_time(tiny_model, encoded)
    for micro in (1, 4, 64):
        lls, forwards = loglikelihoods(tiny_model, encoded, micro, share=False)
        assert forwards == math.ceil(len(encoded) / micro)
        assert np.allclose(lls, alone, rtol=1e-6, atol=1e-4)
    plan = batches(encoded, 4, share=False)
    assert [sum(len(r.members) for r in b) for b in plan] == [4, 2]
    widths = [len(encoded[i].inputs) for b in plan for r in b for i in r.members]
    assert widths == sorted(widths, reverse=True)  # longest first: little padding


def test_a_context_is_computed_once_for_its_choices(tokenizer, tiny_model):
    """The choices of one context share a row (the context once, each choice after it under a mask
    by which it sees the context and itself): the same ll as one request per forward, fewer
    positions computed, and a row of more choices than micro_batch is a forward of its own."""
    # 512: the 5-shot context (~340 tokens) whole, so the four choices of a document share it (at 64
    # only choices whose continuations have one length share their truncated window: the reference test)
    encoded = Encoder(tokenizer, 512).encode_task(olmes_task("arc_easy_rc_5shot", limit=4))
    alone = _one_at_a_time(tiny_model, encoded)
    for micro in (1, 4, 7, 64):
        lls, forwards = loglikelihoods(tiny_model, encoded, micro, share=True)
        assert np.allclose(lls, alone, rtol=1e-6, atol=1e-4), micro
    plan = batches(encoded, 4, share=True)
    assert all(len(r.members) == 4 for b in plan for r in b)  # four choices of one context per row
    assert sum(r.width(encoded) for b in plan for r in b) < sum(len(e.inputs) for e in encoded) * 0.5
    assert loglikelihoods(tiny_model, encoded, 1, share=True)[1] == 4  # one row per forward, not one choice
    # PIQA: two choices per context; the builtin task's choices are contexts (nothing shared)
    piqa = Encoder(tokenizer, 512).encode_task(olmes_task("piqa_rc_0shot", limit=3))
    assert [len(r.members) for b in batches(piqa, 64) for r in b] == [2, 2, 2]
    builtin = Encoder(tokenizer, SEQ_LEN).encode_task(builtin_task(limit=3))
    assert {len(r.members) for b in batches(builtin, 64) for r in b} == {1}


def test_the_runners_model_computes_the_head_on_the_scored_positions_only(tokenizer, tiny_model):
    """RunnerLlama takes `score_at`: the lm_head sees one row per target position (never a context's
    positions), and every ll equals transformers' own model with the same weights."""
    from runner.training.model import RunnerLlama

    runner_model = RunnerLlama(tiny_model.config).eval()
    runner_model.load_state_dict(tiny_model.state_dict())
    encoded = Encoder(tokenizer, 512).encode_task(olmes_task("arc_easy_rc_5shot", limit=4))
    rows_seen: list[int] = []
    hook = runner_model.lm_head.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    try:
        lls, forwards = loglikelihoods(runner_model, encoded, 4, share=True)
    finally:
        hook.remove()
    reference, _ = loglikelihoods(tiny_model, encoded, 4, share=True)
    assert np.allclose(lls, reference, rtol=1e-6, atol=1e-5)
    assert len(rows_seen) == forwards and sum(rows_seen) == sum(len(e.targets) for e in encoded)


def test_sharing_follows_the_attention_implementation(tokenizer, tiny_model):
    """eager takes an additive mask, sdpa a boolean one; another implementation shares nothing."""
    from runner.training.downstream.score import mask_kind_of

    encoded = Encoder(tokenizer, SEQ_LEN).encode_task(olmes_task("arc_easy_rc_5shot", limit=2))
    alone = _one_at_a_time(tiny_model, encoded)
    assert mask_kind_of(tiny_model) == "bool"
    previous = tiny_model.config._attn_implementation
    try:
        tiny_model.set_attn_implementation("eager")
        assert mask_kind_of(tiny_model) == "additive"
        lls, _ = loglikelihoods(tiny_model, encoded, 8)
        assert np.allclose(lls, alone, rtol=1e-6, atol=1e-4)
    finally:
        tiny_model.set_attn_implementation(previous)
    from types import SimpleNamespace

    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"), training=False)
    assert mask_kind_of(flash) is None
    with pytest.raises(ValueError, match="needs an attention implementation"):
        loglikelihoods(flash, encoded, 8, share=True)


def test_ranks_run_the_same_forwards_and_every_request_is_scored_once(tokenizer, tiny_model):
    encoded = Encoder(tokenizer, SEQ_LEN).encode_task(builtin_task(limit=5))  # 20 requests: 3 batches of 8
    single, _ = loglikelihoods(tiny_model, encoded, 8)
    parts = []
    for rank in range(2):
        parts.append(loglikelihoods(tiny_model, encoded, 8, rank=rank, world=2, all_reduce=lambda t: t))
    assert parts[0][1] == parts[1][1] == 2  # rank 1 runs batch 0 again to keep step with rank 0
    summed = np.add(parts[0][0], parts[1][0])
    assert np.allclose(summed, single, rtol=0, atol=1e-5)
    assert all((a == 0.0) != (b == 0.0) for a, b in zip(parts[0][0], parts[1][0]))


def test_scoring_leaves_a_training_model_in_training_mode(tokenizer, tiny_model):
    encoded = Encoder(tokenizer, SEQ_LEN).encode_task(builtin_task(limit=1))
    tiny_model.train()
    try:
        loglikelihoods(tiny_model, encoded, 4)
        assert tiny_model.training
    finally:
        tiny_model.eval()


def test_metrics_follow_each_convention():
    # doc 0: raw ll picks 0; per character of the choice (less one " ") picks 1; per character as
    # given too; per token picks 1. doc 1: a tie goes to the lowest index.
    docs = (
        Document(0, 1, (Request("q", " ab"), Request("q", " abcdefgh"))),
        Document(1, 0, (Request("q", " x"), Request("q", " y"), Request("q", " z"))),
    )
    task = Task("t", "mc", "0" * 64, None, docs, 2, None, 0, ("acc",), None, " ", "t")
    lls = [-4.0, -6.0, -1.0, -1.0, -3.0]
    tokens = [1, 4, 1, 1, 1]
    m = task_metrics(task, lls, tokens)
    assert m["acc"] == 0.5  # doc 0 wrong (0), doc 1 right (tie -> 0)
    assert m["acc_norm"] == 1.0  # -4/2 = -2 < -6/8 = -0.75
    assert m["acc_per_char"] == 1.0  # -4/3 < -6/9
    assert m["acc_per_token"] == 1.0  # -4/1 < -6/4
    b = (1 / 2 + 1 / 3) / 2
    assert m["centered_acc"] == pytest.approx((0.5 - b) / (1 - b))
    assert m["bpb"] == pytest.approx((6.0 / (math.log(2) * 9) + 1.0 / (math.log(2) * 2)) / 2)
    stated = Task("t", "mc", "0" * 64, None, docs, 2, None, 0, ("acc",), 0.25, " ", "t")
    assert task_metrics(stated, lls, tokens)["centered_acc"] == pytest.approx((0.5 - 0.25) / 0.75)
    other = Task("u", "mc", "0" * 64, None, docs, 2, None, 0, ("acc_norm",), None, " ", "u")
    mu = task_metrics(other, lls, tokens)
    assert aggregate([task, other], {"t": m, "u": mu}, "mean_centered") == pytest.approx(
        (m["centered_acc"] + mu["centered_acc_norm"]) / 2
    )
    assert aggregate([task], {"t": m}, "none") is None


# --- the reference: lm-evaluation-harness 0.4.13 HFLM ----------------------------------------


@pytest.mark.slow
def test_loglikelihoods_and_answers_match_lm_eval_hflm(tmp_path, tokenizer, tiny_model):
    """Every request's ll within 1e-4 + 1e-6 |ll| of HFLM's (dtype float32, max_length = seq_len) on
    the same weights saved as a transformers folder, and the same chosen answers."""
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:  # the `eval` extra is not installed
        pytest.skip(f"lm_eval (the `eval` extra, lm-eval==0.4.13) cannot be imported: {e}")
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "hf"
    tiny_model.save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_PATH), eos_token="<|endoftext|>", split_special_tokens=True
    ).save_pretrained(folder)
    lm = HFLM(pretrained=str(folder), dtype="float32", max_length=SEQ_LEN, batch_size=16, device="cpu")
    encoder = Encoder(tokenizer, SEQ_LEN)
    tasks = [builtin_task(limit=8), olmes_task("arc_easy_rc_5shot", limit=8), olmes_task("piqa_rc_0shot", limit=8)]
    for task in tasks:
        encoded = encoder.encode_task(task)
        ours, _ = loglikelihoods(tiny_model, encoded, 7)  # sdpa: a context's choices share its row
        plain, _ = loglikelihoods(tiny_model, encoded, 7, share=False)
        instances = [
            Instance("loglikelihood", {}, (r.context, r.continuation), n) for n, (_, _, r) in enumerate(task.requests)
        ]
        ref = np.array([ll for ll, _ in lm.loglikelihood(instances, disable_tqdm=True)])
        assert np.all(np.abs(np.array(ours) - ref) <= 1e-4 + 1e-6 * np.abs(ref)), task.name
        assert np.all(np.abs(np.array(plain) - ref) <= 1e-4 + 1e-6 * np.abs(ref)), task.name
        lengths = [len(e.targets) for e in encoded]
        mine, theirs = task_metrics(task, ours, lengths), task_metrics(task, list(ref), lengths)
        assert mine["bpb"] == pytest.approx(theirs["bpb"], rel=1e-6)
        assert {k: v for k, v in mine.items() if k != "bpb"} == {k: v for k, v in theirs.items() if k != "bpb"}
        # lm-eval's own acc_norm divides by the length of the document's choice text
        if task.format == "olmes":
            rows = [json.loads(line) for line in gzip.open(task.source, "rt")]
            choices = {r["doc_id"]: r["doc"]["choices"] for r in rows if r["doc_id"] < 1_000_000}
            pos, ours_norm, ref_norm = 0, [], []
            for d in task.documents:
                n = np.array([float(len(c)) for c in choices[d.doc_id]])
                ours_norm.append(int(np.argmax(np.array(ours[pos : pos + d.choices]) / n)))
                ref_norm.append(int(np.argmax(ref[pos : pos + d.choices] / n)))
                pos += d.choices
            assert ours_norm == ref_norm
            gold = np.array([d.gold for d in task.documents])
            assert task_metrics(task, ours, lengths)["acc_norm"] == float(np.mean(np.array(ref_norm) == gold))
