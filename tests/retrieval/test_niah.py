"""Needle in a haystack: needle documents, scoring, the grid on a tiny trained model, and the
training-data needle mixture (deterministic, train text only, resume-exact)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slimkv.cli import main
from slimkv.data import load_dataset
from slimkv.data.ruler_needles import NEEDLE_TEMPLATE, QUESTION_TEMPLATE, NeedleBuilder, NeedleMixture, value_found
from slimkv.retrieval.runs import TASKS, parse_lengths, value_token_scores
from slimkv.train import train
from tests.train.tiny import one_thread, tiny_cache, tiny_config, tiny_env  # noqa: F401  (fixtures)

MIX_SEQ_LEN = 192  # the tiny 300-id BPE spells the needle, question and answer in ~165 tokens


def find_all(haystack: list[int], piece: list[int]) -> list[int]:
    """Start indices of every occurrence of ``piece`` in ``haystack``."""
    n = len(piece)
    return [i for i in range(len(haystack) - n + 1) if haystack[i : i + n] == piece]


def contains(source: np.ndarray, piece: list[int]) -> bool:
    """Whether ``piece`` is a contiguous run of ``source`` (wrapping around its end)."""
    extended = np.concatenate([source, source[: len(piece)]])
    windows = np.lib.stride_tricks.sliding_window_view(extended, len(piece))
    return bool((windows == np.asarray(piece)).all(axis=1).any())


@pytest.mark.parametrize("length", [220, 400])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_document_has_one_needle_at_the_depth_and_ends_with_the_question(length, depth):
    dataset = load_dataset("tiny")
    builder = NeedleBuilder.for_dataset(dataset)
    doc = builder.build(dataset.val, start=37, length=length, depth=depth, key="apple", value="1234567")
    needle = dataset.encode(NEEDLE_TEMPLATE.format(key="apple", value="1234567"))
    question = dataset.encode(QUESTION_TEMPLATE.format(key="apple"))
    assert len(doc.ids) == length == doc.prompt_tokens  # exact, not approximately
    assert find_all(doc.ids, needle) == [doc.needle_start]
    assert doc.ids[-len(question) :] == question
    assert dataset.decode(doc.ids).count("special magic numbers for apple is: 1234567.") == 1
    # the needle is a line of its own, as close to the depth as the line boundaries allow
    assert doc.needle_start == 0 or dataset.decode(doc.ids[: doc.needle_start]).endswith("\n")
    longest_line = 20  # tokens; the tiny grammar's lines are shorter (the last one may be cut short)
    assert abs(doc.needle_start - depth * doc.haystack_tokens) <= (longest_line if depth == 1.0 else longest_line / 2 + 1)
    assert doc.depth == pytest.approx(doc.needle_start / doc.haystack_tokens)
    haystack = doc.ids[: doc.needle_start] + doc.ids[doc.needle_start + len(needle) : -len(question)]
    assert len(haystack) == doc.haystack_tokens and contains(dataset.val, haystack)


def test_training_document_ends_with_the_answer_and_short_lengths_are_refused():
    dataset = load_dataset("tiny")
    builder = NeedleBuilder.for_dataset(dataset)
    doc = builder.build(dataset.train, start=0, length=300, depth=0.5, key="zebra", value="7654321", answer=True)
    assert len(doc.ids) == 300 and dataset.decode(doc.ids).endswith("for zebra is: 7654321.\n")
    with pytest.raises(ValueError, match="length=100 is too short"):
        builder.build(dataset.val, start=0, length=100, depth=0.5, key="zebra", value="7654321")


def test_scoring_is_case_insensitive_and_needs_the_exact_value():
    assert value_found("1234567", "The special magic number is: 1234567.")
    assert value_found("ab12-CD", "is: AB12-cd and more")
    assert not value_found("1234567", "is: 123456 7")  # a piece of it is not enough
    assert not value_found("1234567", "is: 12345678")  # nor inside a longer number
    assert not value_found("1234567", "is: 7654321")


def test_lengths_accept_multiples_of_the_training_length():
    assert parse_lengths("1x,2x,300", 128) == [128, 256, 300]
    with pytest.raises(ValueError, match="--lengths"):
        parse_lengths("1x,abc", 128)


@pytest.fixture(scope="module")
def kvm_run(tmp_path_factory, tiny_cache):  # noqa: F811
    """A few steps of a tiny KVM model (chunks of 8: at 256+ tokens the state is compressed)."""
    run_dir = tmp_path_factory.mktemp("niah") / "kvm"
    options = {"chunk_size": 8, "schedule": "fixed", "min_rows": 8}
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("SLIMKV_CACHE", str(tiny_cache))
        train(tiny_config(attention="kvm", attention_options=options, steps=3), run_dir, progress=False)
    return run_dir


def test_niah_cli_writes_the_grid_json_and_png(kvm_run, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["eval", "niah", str(kvm_run), "--tasks", "s1,s2,s3", "--lengths", "256,320", "--depths", "0,0.5,1",
                 "--samples", "2", "--max-new-tokens", "3", "--out", str(out), "--no-progress"])
    assert code == 0
    report = json.loads((out / "niah.json").read_text())
    assert list(report["tasks"]) == ["s1", "s2", "s3"] and report["lengths"] == [256, 320] and report["train_seq_len"] == 32
    for task, result in report["tasks"].items():
        grid = np.asarray(result["accuracy"])
        assert grid.shape == (2, 3) and ((grid >= 0) & (grid <= 1)).all()
        assert result["mean_per_length"] == pytest.approx(grid.mean(axis=1).tolist())
        assert result["description"] == TASKS[task]["description"]
        assert all(e["hit"] == value_found(e["value"], e["output"]) for e in result["examples"])
        tokens = np.asarray(result["value_token_accuracy"])
        assert tokens.shape == (2, 3) and ((tokens >= 0) & (tokens <= 1)).all() and (np.asarray(result["value_token_nll"]) > 0).all()
    assert report["tasks"]["s3"]["value_tokens_max"] > 3  # a UUID cannot fit in 3 new tokens: the table says so
    assert (out / "niah.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "s2: held-out prose" in printed and "WARNING: s3 values take up to" in printed


def test_niah_rejects_unknown_tasks_before_work(kvm_run):
    with pytest.raises(ValueError, match="'s9' is not allowed; allowed values: s1, s2, s3"):
        _run_niah(kvm_run, "s1,s9")


def _run_niah(run_dir, tasks: str) -> None:
    from slimkv.cli.eval import task_parser

    args = task_parser("niah").parse_args([str(run_dir), "--tasks", tasks])
    args.task_run(args)


class TrainOnly:
    """A dataset whose val split must never be read (reading it fails the test)."""

    def __init__(self, dataset) -> None:
        self.train, self.tokenizer, self.encode = dataset.train, dataset.tokenizer, dataset.encode

    @property
    def val(self):
        raise AssertionError("the needle mixture read the val split")


def test_mixture_is_deterministic_uses_train_text_only_and_replaces_the_fraction():
    dataset = load_dataset("tiny")
    batch = torch.zeros(8, MIX_SEQ_LEN + 1, dtype=torch.long)
    mix = NeedleMixture(TrainOnly(dataset), MIX_SEQ_LEN, 0.5, seed=3)
    first = mix.apply(batch, step=5)
    assert torch.equal(first, NeedleMixture(TrainOnly(dataset), MIX_SEQ_LEN, 0.5, seed=3).apply(batch, step=5))
    assert not torch.equal(first, NeedleMixture(TrainOnly(dataset), MIX_SEQ_LEN, 0.5, seed=4).apply(batch, step=5))
    assert not torch.equal(first, mix.apply(batch, step=6))
    replaced = [row for row in range(8) if first[row].any()]
    assert replaced == mix.rows(5, 8) and len(replaced) == 4
    for row in replaced:
        doc = mix.document(5, row)
        assert first[row].tolist() == doc.ids and "special magic number" in dataset.decode(doc.ids)
        needle = dataset.encode(NEEDLE_TEMPLATE.format(key=doc.key, value=doc.value))
        question_and_answer = len(doc.ids) - doc.prompt_tokens + len(dataset.encode(QUESTION_TEMPLATE.format(key=doc.key)))
        haystack = doc.ids[: doc.needle_start] + doc.ids[doc.needle_start + len(needle) : len(doc.ids) - question_and_answer]
        assert contains(dataset.train, haystack) and not contains(dataset.val, haystack)
    three_tenths = NeedleMixture(TrainOnly(dataset), MIX_SEQ_LEN, 0.3, seed=0)
    counts = [len(three_tenths.rows(step, 10)) for step in range(200)]
    assert set(counts) == {3} and np.mean([len(mix.rows(s, 3)) for s in range(400)]) == pytest.approx(1.5, abs=0.1)
    with pytest.raises(ValueError, match="needle_mix needs seq_len >= "):
        NeedleMixture(dataset, 32, 0.5, seed=0)


def test_training_with_the_mixture_resumes_exactly(tmp_path):
    cfg = tiny_config(seq_len=MIX_SEQ_LEN, needle_mix=0.5, needle_seed=1, steps=4, checkpoint_every=2, eval_every=2)
    train(cfg, tmp_path / "straight", progress=False)
    assert train(cfg, tmp_path / "split", progress=False, stop_after=2)["step"] == 2
    train(cfg, tmp_path / "split", resume=True, progress=False)
    straight, split = (load_file(tmp_path / name / "checkpoint" / "model.safetensors") for name in ("straight", "split"))
    assert all(torch.equal(straight[k], split[k]) for k in straight)
    plain = tiny_config(seq_len=MIX_SEQ_LEN, steps=4, checkpoint_every=2, eval_every=2)
    train(plain, tmp_path / "plain", progress=False)
    first_loss = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["loss"] for name in ("straight", "plain")}
    assert first_loss["straight"] != first_loss["plain"]  # the mixture changed what the model trained on
    with pytest.raises(ValueError, match="needle_mix"):
        tiny_config(needle_mix=1.5)


class _NextTokenOracle(torch.nn.Module):
    """Logits that put all mass on the true next token (``right``) or on a wrong one: it knows the sequences."""

    def __init__(self, sequences: list[list[int]], vocab: int, right: bool):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.sequences, self.vocab, self.right = sequences, vocab, right

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, self.vocab)
        for b, row in enumerate(ids.tolist()):
            full = next(seq for seq in self.sequences if seq[: len(row)] == row)
            for t in range(len(row)):
                target = full[t + 1] if self.right else (full[t + 1] + 1) % self.vocab
                logits[b, t, target] = 30.0
        return SimpleNamespace(logits=logits)


def test_value_token_scores_score_exactly_the_value_tokens():
    """An oracle that predicts every next token scores 1 (NLL ~0); one that is always wrong scores 0."""
    encode = lambda text: [ord(c) for c in text]  # noqa: E731  (character-level ids)
    builder = NeedleBuilder(encode, np.array([ord("\n")]))
    source = np.array(encode("a line of prose\n" * 40))
    docs = [builder.build(source, 0, 160, depth, key, value) for depth, key, value in ((0.3, "apple", "1234567"), (0.8, "river", "7654321"))]
    sequences = [d.ids + builder.pieces(d.key, d.value, answer=True)[2] for d in docs]
    accuracy, nll = value_token_scores(_NextTokenOracle(sequences, 256, right=True), builder, docs, batch_size=2)
    assert accuracy == 1.0 and nll < 1e-6
    accuracy, nll = value_token_scores(_NextTokenOracle(sequences, 256, right=False), builder, docs, batch_size=1)
    assert accuracy == 0.0 and nll == pytest.approx(30.0, rel=1e-3)
