"""The ground floor: helpers every other part of slimkv may use and which import nothing from it.

``checks`` (option validators), ``files`` (atomic files and folders, run locks), ``paths`` (the
asset cache folder), ``timing`` (benchmark timing and result files), ``buffer`` (the growable
cache storage), ``plotting`` (figures without global backend state), ``spec`` (the one
grammar for "layer kinds + options") and ``workers`` (independent runs in worker processes). See docs/architecture.md for the floors.
"""
