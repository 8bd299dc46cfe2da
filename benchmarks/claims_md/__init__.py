"""claims.md's sections: the figures (``figures``), the verdict rules (``rules``) and the template (``claims.md.in``) benchmarks/claims.py renders."""
