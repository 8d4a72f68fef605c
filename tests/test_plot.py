"""`megatrain plot`: what it may replace (only its own plots, with --overwrite), the format the
suffix names, short runs, and smoothing that does not lag."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from test_cli import run_cli

from megatrain.plot import _smooth, draw, read_metrics
from megatrain.plotfile import written_by_megatrain

pytest.importorskip("matplotlib")


def _metrics(directory: Path, steps: int) -> Path:
    directory.mkdir(exist_ok=True)
    recs = [
        {"step": s, "loss": 5 - s / 20, "grad_norm": 2.0, "lr": 1e-3, "tokens_per_s": 1000.0}
        for s in range(1, steps + 1)
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return directory


def _refused(capsys, *argv) -> str:
    rc, _, err = run_cli(capsys, "plot", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    return lines[0]


def test_plot_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    out = _metrics(tmp_path / "run", 30)
    mine = out / "training.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n my own figure")  # the user's, of the same name
    essay = tmp_path / "essay.txt"
    essay.write_text("an essay")
    for flags in ([], ["--overwrite"]):
        assert "is not a plot megatrain wrote" in _refused(capsys, out, *flags)
        assert "plot writes .png, .jpg, .jpeg, .svg, .pdf files" in _refused(
            capsys, out, "--out", essay, *flags
        )
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n my own figure" and essay.read_text() == "an essay"

    plot = tmp_path / "plot.png"
    rc, stdout, _ = run_cli(capsys, "plot", out, "--out", plot)
    assert rc == 0 and str(plot) in stdout and written_by_megatrain(plot)
    # Its own plot: replaced only when asked.
    assert "exists (a plot megatrain wrote); --overwrite replaces it" in _refused(capsys, out, "--out", plot)
    _metrics(out, 40)
    before = plot.read_bytes()
    rc, _, _ = run_cli(capsys, "plot", out, "--out", plot, "--overwrite")
    assert rc == 0 and plot.read_bytes() != before and written_by_megatrain(plot)
    # Once changed by anyone else, it is no longer provably megatrain's.
    plot.write_bytes(plot.read_bytes()[:-1] + b"\x00")
    assert not written_by_megatrain(plot)
    changed = plot.read_bytes()
    assert "is not a plot megatrain wrote" in _refused(capsys, out, "--out", plot, "--overwrite")
    assert plot.read_bytes() == changed
    assert not [p for p in (*tmp_path.iterdir(), *out.iterdir()) if p.name.startswith(".")]


@pytest.mark.parametrize(
    "suffix,magic", [(".png", b"\x89PNG"), (".jpg", b"\xff\xd8"), (".svg", b"<?xml"), (".pdf", b"%PDF")]
)
def test_plot_writes_the_format_its_suffix_names(tmp_path, capsys, suffix, magic):
    out = _metrics(tmp_path / "run", 30)
    target = tmp_path / f"figure{suffix}"
    rc, _, err = run_cli(capsys, "plot", out, "--out", target)
    assert rc == 0, err
    data = target.read_bytes()
    assert data.startswith(magic) and written_by_megatrain(target)
    if suffix in (".png", ".jpg"):  # the mark keeps the file valid: Pillow decodes it (CRCs checked)
        from PIL import Image

        with Image.open(target) as im:
            im.load()
            assert im.size == (1210, 770)
    # The mark proves the whole file: a copy under another suffix's rule is not provably ours.
    other = tmp_path / ("figure.svg" if suffix != ".svg" else "figure.pdf")
    other.write_bytes(data)
    assert not written_by_megatrain(other)


def test_plot_refuses_a_suffix_it_cannot_write(tmp_path, capsys):
    out = _metrics(tmp_path / "run", 3)
    for name in ("figure.gif", "figure"):
        assert "plot writes .png, .jpg, .jpeg, .svg, .pdf files" in _refused(
            capsys, out, "--out", tmp_path / name
        )
        assert not (tmp_path / name).exists()


def test_short_runs_show_every_point_on_whole_steps(tmp_path):
    for steps in (1, 3):
        records, evals = read_metrics(_metrics(tmp_path / f"run{steps}", steps))
        fig = draw(records, evals, "run")
        for ax in fig.axes:
            line = ax.get_lines()[0]
            assert list(line.get_xdata()) == list(range(1, steps + 1))
            assert line.get_marker() not in (None, "None", "", " ")  # one point is a dot, not nothing
            ticks = ax.xaxis.get_major_locator()()
            assert all(float(t).is_integer() for t in ticks), ticks


def test_smoothing_follows_a_falling_loss_without_lag():
    """A falling loss with noise: the smoothed line sits on the trend (an exponential average
    sits above it by its lag times the slope), and it smooths."""
    rng = random.Random(0)
    n, slope = 400, -0.01
    trend = [5 + slope * i for i in range(n)]
    noise = [rng.gauss(0, 0.05) for _ in range(n)]
    smoothed = _smooth([t + e for t, e in zip(trend, noise)], max(2, n // 100))
    assert _smooth(trend, 4) == pytest.approx(trend, abs=1e-9)  # a straight line is kept exactly
    bias = sum(s - t for s, t in zip(smoothed, trend)) / n
    assert abs(bias) < 0.005  # the old EMA: +0.035 (3.5 steps of lag x 0.01)
    inner = [s - t for s, t in zip(smoothed[4:-4], trend[4:-4])]
    spread = math.sqrt(sum(d * d for d in inner) / len(inner))
    assert spread < 0.5 * 0.05
    # Gaps (skipped steps) are left out of the average, not read as zeros.
    assert _smooth([4.0, None, 2.0], 1) == pytest.approx([4.0, 3.0, 2.0])
    assert math.isnan(_smooth([None], 2)[0])


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys

    out = _metrics(tmp_path / "run", 3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    line = _refused(capsys, out)
    assert line == "megatrain: error: plot needs matplotlib (pip install 'megatrain[plot]')"
    assert not (out / "training.png").exists()
