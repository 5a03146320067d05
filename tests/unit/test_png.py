"""Plots for docs/ are palette PNGs (kvpush_bench.png): smaller, and the same to the eye."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageChops, ImageStat

from kvpush_bench import png


def test_a_plot_is_saved_as_a_palette_png_close_to_matplotlibs(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    for i in range(4):
        ax.plot([1, 2, 4, 8], [i + 1, i * 2 + 1, i * 3 + 2, i * 5 + 1], "-o", label=str(i))
    ax.legend()
    fig.savefig(tmp_path / "rgba.png", dpi=80)
    png.save(fig, tmp_path / "p.png", dpi=80)
    plt.close(fig)
    with Image.open(tmp_path / "p.png") as small, Image.open(tmp_path / "rgba.png") as full:
        assert small.mode == "P" and small.size == full.size
        diff = ImageChops.difference(small.convert("RGB"), full.convert("RGB"))
        assert max(ImageStat.Stat(diff).mean) < 1.0  # of 255, per channel
    assert (tmp_path / "p.png").stat().st_size < (tmp_path / "rgba.png").stat().st_size
