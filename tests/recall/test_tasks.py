"""The recall tasks: the MQAR generator (layout, determinism, length scaling, option checks), the
prose needles, and that both implement the ``RecallTask`` protocol."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from slimkv.recall.mqar import BOS, FILLER, FIRST_KEY, MQARTask, make_batch, query_gaps
from slimkv.recall.prose_needles import ProseNeedleTask, _needle_position
from slimkv.recall.registry import TASKS, task_from_dict
from slimkv.recall.task import IGNORE, RecallBatches, RecallTask, answer_index, eval_set, unpack


def check_layout(task: MQARTask, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Every invariant of docs/recall.md, row by row."""
    n = task.n_pairs
    assert (inputs[:, 0] == BOS).all()
    keys, values = inputs[:, 1 : 2 * n + 1 : 2], inputs[:, 2 : 2 * n + 2 : 2]
    assert ((keys >= FIRST_KEY) & (keys < task.first_value)).all()
    assert ((values >= task.first_value) & (values < task.vocab_size)).all()
    for row in range(inputs.shape[0]):
        pairs = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert len(pairs) == n, "keys of one sequence are distinct"
        scored = torch.nonzero(targets[row] != IGNORE).flatten().tolist()
        assert len(scored) == task.queries
        assert len({int(inputs[row, p]) for p in scored}) == task.queries, "each query asks a different pair"
        for p in scored:
            assert p >= task.first_slot and (p - task.first_slot) % 2 == 0
            key = int(inputs[row, p])
            assert targets[row, p] == pairs[key] == inputs[row, p + 1]
        region = inputs[row, task.first_slot :]
        assert int(((region >= FIRST_KEY) & (region < task.first_value)).sum()) == task.queries, "keys appear in the query region only as queries"
        assert set(region.tolist()) <= {FILLER} | set(pairs) | set(pairs.values())


@pytest.mark.parametrize(
    "task",
    [MQARTask(), MQARTask(gap="uniform", query_start=33), MQARTask(n_queries=3), MQARTask(vocab_size=60, seq_len=52, n_pairs=12)],
    ids=["default", "uniform-late", "fewer-queries", "small-vocab"],
)
def test_batches_follow_the_layout(task):
    check_layout(task, *make_batch(task, 64, np.random.default_rng(1)))
    for factor in (f for f in (2, 4) if task.n_keys >= f * task.n_pairs):
        scaled = task.scaled(factor)
        assert scaled.seq_len == task.seq_len * factor and scaled.n_pairs == task.n_pairs * factor
        check_layout(scaled, *make_batch(scaled, 16, np.random.default_rng(factor)))


def test_a_diverse_haystack_replaces_only_the_fillers():
    """haystack_tokens: the same pairs, queries and answers as without it (one rng draw more, at
    the end), every filler replaced by an id after the task's vocabulary."""
    plain, diverse = MQARTask(), MQARTask(haystack_tokens=500)
    x0, y0 = make_batch(plain, 32, np.random.default_rng(3))
    x1, y1 = make_batch(diverse, 32, np.random.default_rng(3))
    filler = x0 == FILLER
    assert torch.equal(y0, y1) and torch.equal(x0[~filler], x1[~filler])
    assert ((x1[filler] >= plain.vocab_size) & (x1[filler] < plain.vocab_size + 500)).all()
    assert len(set(x1[filler].tolist())) > 100
    assert diverse.model_vocab_size == plain.vocab_size + 500 and plain.model_vocab_size == plain.vocab_size
    assert "haystack_tokens" not in plain.to_dict() and diverse.to_dict()["haystack_tokens"] == 500


def test_gaps_are_query_minus_context_position():
    task = MQARTask()
    inputs, targets = make_batch(task, 32, np.random.default_rng(0))
    gaps = query_gaps(inputs, targets)
    rows, positions = torch.nonzero(targets != IGNORE, as_tuple=True)
    for gap, row, position in zip(gaps.tolist(), rows.tolist(), positions.tolist()):
        context_position = inputs[row, : 2 * task.n_pairs + 1].tolist().index(int(inputs[row, position]))
        assert gap == position - context_position >= 2
    power, uniform = MQARTask(), MQARTask(gap="uniform")
    median = [float(query_gaps(*make_batch(t, 256, np.random.default_rng(3))).median()) for t in (power, uniform)]
    assert median[0] < median[1], "power-law placement puts queries closer to the context than uniform placement"


def test_batches_are_a_function_of_seed_and_step():
    task = MQARTask()
    a, b, other = RecallBatches(task, 5, (2, 8)), RecallBatches(task, 5, (2, 8)), RecallBatches(task, 6, (2, 8))
    assert torch.equal(a.sample(3, 8), b.sample(3, 8))
    assert not torch.equal(a.sample(3, 8), other.sample(3, 8))
    b.sample(0, 8)  # drawing other steps first changes nothing: no hidden position
    assert torch.equal(a.sample(7, 8), b.sample(7, 8))
    inputs, targets = unpack(a.sample(0, 4))
    assert int((targets[0] != IGNORE).sum()) == 2, "step 0 uses the first entry of the mixture (2 pairs)"
    inputs, targets = unpack(a.sample(1, 4))
    assert int((targets[0] != IGNORE).sum()) == 8
    assert torch.equal(eval_set(task, 4)[0], eval_set(task, 4)[0])
    assert not torch.equal(eval_set(task, 4)[0], eval_set(task, 4, seed=1)[0])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_pairs": 70}, "n_pairs=70 needs at least 70 key ids"),
        ({"seq_len": 20}, "raise seq_len to >= 33"),
        ({"gap": "normal"}, "gap='normal' is not allowed; allowed values: power, uniform"),
        ({"n_queries": 9}, "n_queries"),
        ({"query_start": 5}, "query_start"),
        ({"power_a": -1.0}, "power_a"),
        ({"vocab_size": 3}, "vocab_size"),
        ({"haystack_tokens": -1}, "haystack_tokens"),
        ({"haystack_tokens": 10**8}, "make 100000130 token ids, more than the 65536 a recall model may have"),
        ({"vocab_size": 10**8}, "vocab_size <= 65536"),
    ],
)
def test_invalid_tasks_name_the_option(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        replace(MQARTask(), **change).validate()
    with pytest.raises(ValueError, match="n_pairs=72 needs"):
        MQARTask().scaled(9)  # 72 pairs do not fit 64 key ids


def test_needle_documents_hold_every_needle_and_ask_each_once(tiny_env):
    task = ProseNeedleTask(dataset="tiny", seq_len=200, n_pairs=3, values="digits", digits=2, keys=10)
    source = task.source
    inputs, targets = task.make_batch(8, np.random.default_rng(0))
    assert inputs.shape == targets.shape == (8, 200)
    index = answer_index(targets)
    assert int(index.max()) + 1 == 8 * 3, "three answers per document"
    assert torch.bincount(index).tolist() == [2] * 24, "each answer is its two digits"
    for row in range(8):
        tokens = inputs[row].tolist()
        scored = torch.nonzero(targets[row] != IGNORE).flatten().tolist()
        for position in scored:
            assert targets[row, position] == inputs[row, position + 1] and int(inputs[row, position + 1]) in source.digits.tolist()
        for first in scored[::2]:
            key = tokens[first]  # the question ends on the key, which predicts the first digit
            needle = _needle_position(tokens, key, task.prefix, set(source.line_ends.tolist()))
            assert needle < first, "the needle comes before its question"
            assert tokens[needle + 1 : needle + 3] == tokens[first + 1 : first + 3], "the answer is the needle's value"
    gaps = task.gaps(inputs, targets)
    assert gaps.shape == (24,) and (gaps > 0).all()
    longer = task.scaled(4)
    assert longer.n_pairs == 3 and longer.make_batch(2, np.random.default_rng(1))[0].shape == (2, 800)
    val = task.for_evaluation()
    assert val.split == "val" and not torch.equal(val.make_batch(2, np.random.default_rng(0))[0], task.make_batch(2, np.random.default_rng(0))[0])
    with pytest.raises(ValueError, match="raise seq_len to >= "):
        replace(task, seq_len=40).validate()
    with pytest.raises(ValueError, match="split='test' is not allowed; allowed values: train, val"):
        replace(task, split="test").validate()


def test_needle_values_can_be_single_words(tiny_env):
    task = ProseNeedleTask(dataset="tiny", seq_len=200, n_pairs=3, keys=4, value_words=5)
    inputs, targets = task.make_batch(4, np.random.default_rng(0))
    source = task.source
    keys, values = set(source.words[:4].tolist()), set(source.words[4:9].tolist())
    scored = torch.nonzero(targets != IGNORE)
    assert len(scored) == 4 * 3 and int(answer_index(targets).max()) + 1 == 12, "one token per answer"
    for row, position in scored.tolist():
        assert int(inputs[row, position]) in keys and int(targets[row, position]) in values
    with pytest.raises(ValueError, match="value_words"):
        replace(task, value_words=100).validate()
    with pytest.raises(ValueError, match="values='letters' is not allowed; allowed values: words, digits"):
        replace(task, values="letters").validate()


def test_needles_without_a_prefix_are_key_value_lines(tiny_env):
    """needle_prefix="none": a needle line is key, value, ".\\n" at a line start; a question is the
    key alone at a line start; the answer is the value that followed that key."""
    task = ProseNeedleTask(dataset="tiny", seq_len=120, n_pairs=3, keys=4, value_words=5, needle_prefix="none").validate()
    assert task.prefix == [] and task.needle_tokens == 1 + 1 + len(task.source.end)
    inputs, targets = task.make_batch(4, np.random.default_rng(0))
    line_ends = set(task.source.line_ends.tolist())
    for row, position in torch.nonzero(targets != IGNORE).tolist():
        tokens = inputs[row].tolist()
        assert tokens[position - 1] in line_ends, "a question starts its own line"
        needle = _needle_position(tokens, tokens[position], task.prefix, line_ends)
        assert needle < position and tokens[needle + 1] == int(targets[row, position])
    assert (task.gaps(inputs, targets) > 0).all()
    with pytest.raises(ValueError, match="needle_prefix='short' is not allowed; allowed values: sentence, none"):
        replace(task, needle_prefix="short").validate()


def protocol_members() -> set[str]:
    """The names ``RecallTask`` declares (attributes, properties and methods)."""
    return {name for name in (*RecallTask.__annotations__, *vars(RecallTask)) if not name.startswith("_")}


@pytest.mark.parametrize("cls", list(TASKS.values()))
def test_every_registered_task_implements_the_protocol(cls):
    missing = {name for name in protocol_members() if not hasattr(cls, name)}
    assert not missing, f"{cls.__name__} lacks {sorted(missing)} of RecallTask"
    assert TASKS[cls.name] is cls


def test_tasks_read_back_from_their_records(tiny_env):
    """``to_dict()`` -> ``task_from_dict`` is the identity, records without a task are MQAR (runs
    made before the second task), and an unknown task or another needles layout is refused."""
    for task in (MQARTask(haystack_tokens=10), ProseNeedleTask(dataset="tiny", seq_len=200, n_pairs=3, keys=10)):
        assert task_from_dict(task.to_dict()) == task
    assert task_from_dict({"seq_len": 32, "n_pairs": 4, "vocab_size": 40}) == MQARTask(seq_len=32, n_pairs=4, vocab_size=40)
    with pytest.raises(ValueError, match="task='ruler' is not allowed; allowed values: mqar, needles"):
        task_from_dict({"task": "ruler"})
    with pytest.raises(ValueError, match="layout 1 was made by another version"):
        task_from_dict({**ProseNeedleTask().to_dict(), "layout": 1})
