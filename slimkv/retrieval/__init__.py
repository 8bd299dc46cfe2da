"""Needle-in-a-haystack retrieval: whether a model still finds what was said far back in its
context (``slimkv eval niah``; docs/evaluation.md, "Needle in a haystack" and "Long-context
retrieval on pretrained models").

One home for the concept, from the prompts to the comparison:

- ``grid``: what both stacks share: the one ``--lengths`` / ``--depths`` grammar (every command
  that takes them parses them there), the runner over task x length x depth cells, the depth x
  length table of the reports and their heatmaps;
- ``runs``: the RULER-style grid (tasks s1/s2/s3) on slimkv training runs (``slimkv eval niah
  RUN_DIR``), on documents of ``slimkv.data.ruler_needles`` (which stays in ``data``: training
  mixes the same needles into its batches);
- ``prompts``: the prompts for pretrained models (passkey, needle-number, ...), in the model's
  own tokenizer; their needles (lines, keys, values, places) come from the same generator,
  ``slimkv.data.ruler_needles``;
- ``models``: the grid on a pretrained, converted or compressed model (``slimkv eval niah
  --model``), resumable, with the live cache it measured;
- ``comparison``: slimkv's models and other tools' generations (kvpress) on the same prompts,
  scored alike (``benchmarks/niah_smollm2.py``).

It evaluates, it does not train: learned recall (models trained to recall, ``slimkv eval recall``)
is ``slimkv.recall``. The package sits beside ``bench`` on floor 6 (it uses ``eval``'s model
loading and cache measurement and ``train``'s run loading; neither package imports the other).
"""
