"""Learned recall: small models trained from scratch to recall what they saw, and the frontier of
recall accuracy against measured cache (``slimkv eval recall``, docs/recall.md).

One home for the concept, from the task to the report:

- ``task``: the ``RecallTask`` protocol every task implements, answers and scoring, fixed test
  sets, stateless training batches;
- ``mqar``: multi-query associative recall (synthetic key-value pairs, ``--task mqar``);
- ``prose_needles``: needles in prose a small model can learn (``--task needles``; the RULER-style
  needles of ``slimkv eval niah`` are ``slimkv.data.ruler_needles``, a different thing);
- ``registry``: the tasks by name, and a task read back from its recorded ``to_dict()``;
- ``recipe``: model shape and training of a run (``RecallRecipe``), the model it builds;
- ``run``: one run (train, then accuracy by length and gap and the live cache), resumable;
- ``frontier``: the sweep of entries x seeds, its ``report.json``, ``report.md`` and plot.

The package sits above ``bench`` (it uses compare's entries and statistics) and below ``demo`` and
``cli`` (docs/architecture.md).
"""
