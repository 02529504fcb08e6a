"""`hybridrl watch`: the live view reads a run's files and draws its curves and samples."""

import builtins
import json

import pytest

from hybridrl.cli import main
from hybridrl.config.schema import MissingExtra
from hybridrl.metrics import watch


def write_run(run_dir, steps=5, partial_line=True):
    rows = [{"step": s, "reward/mean": float(s), "actor/entropy": 1.0} for s in range(1, steps + 1)]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (run_dir / "metrics.jsonl").write_text(text + ('{"step": 6, "rew' if partial_line else ""))
    samples = [{"step": 4, "prompt": "1+1=", "completion": "3", "reward": 0.0},
               {"step": 5, "prompt": "2+2=", "completion": "4", "reward": 1.0}]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples) + '{"step"')


def test_sparkline_by_hand():
    assert watch.sparkline([0.0, 1.0, 0.5]) == "▁█▅"
    assert watch.sparkline([2.0, 2.0]) == "▁▁"
    assert watch.sparkline([float("nan")]) == ""
    assert len(watch.sparkline(list(range(100)))) == watch.HISTORY


def test_watch_once_draws_curves_and_the_latest_samples(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "150")
    write_run(tmp_path)
    assert main(["watch", str(tmp_path), "--once"]) == 0
    out = capsys.readouterr().out
    assert "step 5" in out and "reward (mean)" in out and "▁▃▅▆█" in out
    assert "samples at step 5" in out and "2+2=" in out and "1+1=" not in out  # only the last step's samples


def test_watch_of_a_wrong_directory_is_one_sentence(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "missing"), "--once"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_watch_without_rich_names_the_extra(tmp_path, monkeypatch):
    write_run(tmp_path)
    real_import = builtins.__import__

    def no_rich(name, *args, **kwargs):
        if name.startswith("rich"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    with pytest.raises(MissingExtra, match=r"hybridrl\[watch\]"):
        watch.render(tmp_path)


def test_plot_without_matplotlib_names_the_extra_in_one_sentence(tmp_path, monkeypatch, capsys):
    """The base install has no matplotlib: `hybridrl plot` ends with exit status 2 and one line naming the extra."""
    import sys

    write_run(tmp_path)
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for name in [name for name in sys.modules if name.startswith("matplotlib")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install 'hybridrl[plot]'" in error, error
    assert not (tmp_path / "curves.png").exists()
