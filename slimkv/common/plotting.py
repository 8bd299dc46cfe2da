"""Figures without global state: ``matplotlib.figure.Figure`` objects, never pyplot.

A ``Figure`` made directly renders with the Agg canvas when saved, so no backend is ever chosen
(``matplotlib.use``) and no figure is registered with pyplot's global manager: library code can
plot from any thread or inside a notebook without changing the user's backend.
"""

from __future__ import annotations

from typing import Any


def new_figure(rows: int = 1, cols: int = 1, *, figsize: tuple[float, float] = (7.0, 4.5), squeeze: bool = True, **subplot_kw: Any):
    """(figure, axes) like ``plt.subplots``, but detached from pyplot (save with ``files.save_figure``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, **({"layout": subplot_kw.pop("layout")} if "layout" in subplot_kw else {}))
    axes = fig.subplots(rows, cols, squeeze=squeeze, **subplot_kw)
    return fig, axes
