"""Draw ``round.svg``, the life of one FedRep round, for docs/concepts.md.

Run from the repository root: ``.venv/bin/python docs/figures/round.py`` (matplotlib, the ``plots`` extra).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "round"  # the same file on every run
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("round.svg")
BODY, HEAD, SERVER, EVAL = "#9ecae1", "#fdae6b", "#c7e9c0", "#dadaeb"


def box(ax, x: float, y: float, w: float, h: float, text: str, color: str) -> None:
    """A rounded box with centred text, (x, y) its lower-left corner."""
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#444")
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)


def arrow(ax, start: tuple[float, float], end: tuple[float, float]) -> None:
    """An arrow from ``start`` to ``end``."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color="#444", lw=1))


def draw() -> plt.Figure:
    """The figure: sampling, three clients' phases, aggregation, personalized evaluation."""
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    ax.set_xlim(0, 10.1)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    box(ax, 0.1, 1.9, 1.5, 0.8, "round r starts\n(one epoch):\nsample clients", SERVER)
    for row, client in enumerate((3, 8, 14)):
        y = 3.5 - row * 1.45
        box(ax, 2.0, y, 1.75, 0.75, f"client {client}: loads the\nbody + its own head", "#f0f0f0")
        box(ax, 4.0, y, 1.3, 0.75, "head phase\n(body frozen)", HEAD)
        box(ax, 5.6, y, 1.3, 0.75, "body phase\n(head frozen)", BODY)
        arrow(ax, (1.6, 2.3), (2.0, y + 0.37))
        arrow(ax, (3.75, y + 0.37), (4.0, y + 0.37))
        arrow(ax, (5.3, y + 0.37), (5.6, y + 0.37))
        arrow(ax, (6.9, y + 0.37), (7.3, 2.3))
    box(ax, 7.3, 1.85, 1.2, 0.9, "aggregate:\nbody = mean\nof the bodies", SERVER)
    box(ax, 8.75, 1.85, 1.2, 0.9, "validate:\neach client\nwith its head", EVAL)
    arrow(ax, (8.5, 2.3), (8.75, 2.3))
    ax.text(
        5.0,
        0.1,
        "heads stay in the client store; bodies go to the server; clients not sampled keep their heads",
        ha="center",
        fontsize=8,
        style="italic",
    )
    return fig


if __name__ == "__main__":
    figure = draw()
    figure.savefig(OUT, bbox_inches="tight", metadata={"Date": None})
    print(OUT)
