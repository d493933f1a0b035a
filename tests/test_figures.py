"""fisherkron.repro.figures: atomic artefacts with provenance records."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from fisherkron.repro import figures  # noqa: E402
from fisherkron.core.conventions import FisherkronError  # noqa: E402


def _fig():
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    return fig


def test_atomic_write_keeps_old_file_and_no_temp_on_failure(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def boom(tmp):
        with open(tmp, "w") as fh:
            fh.write("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        figures.atomic_write(target, boom)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_save_figure_writes_png_pdf_and_provenance(tmp_path):
    params = {"seeds": 3, "ranks": [1, 2]}
    paths = figures.save_figure(_fig(), "fig_x", tmp_path, params, notebook="notebooks/x.py", started=0.0)
    assert [p.name for p in paths] == ["fig_x.png", "fig_x.pdf", "fig_x.provenance.json"]
    assert (tmp_path / "fig_x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "fig_x.pdf").read_bytes()[:5] == b"%PDF-"
    rec = json.loads((tmp_path / "fig_x.provenance.json").read_text())
    assert rec["name"] == "fig_x" and rec["parameters"] == params and rec["notebook"] == "notebooks/x.py"
    assert rec["files"] == ["fig_x.png", "fig_x.pdf"]
    assert rec["wall_seconds"] > 0 and set(rec["git"]) == {"commit", "dirty"}
    assert {"platform", "cpu", "cpu_count", "torch"} <= set(rec["machine"])
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_files_get_the_umask_permissions_not_mkstemp_0600(tmp_path):
    old = os.umask(0o022)
    try:
        p = figures.atomic_write(tmp_path / "a.txt", lambda t: open(t, "w").close())
    finally:
        os.umask(old)
    assert p.stat().st_mode & 0o777 == 0o644


def test_pdf_is_reproducible(tmp_path):
    figures.save_figure(_fig(), "a", tmp_path / "1")
    figures.save_figure(_fig(), "a", tmp_path / "2")
    assert (tmp_path / "1" / "a.pdf").read_bytes() == (tmp_path / "2" / "a.pdf").read_bytes()


def test_save_table_csv_markdown_latex(tmp_path):
    df = pd.DataFrame({"method_name": ["svd", "gfwsvd"], "acc": [0.5, 0.123456], "rank": [1, 2]})
    paths = figures.save_table(df, "tab_x", tmp_path, {"p": 1}, floatfmt=".3f", caption="A & B", label="tab:x")
    assert [p.name for p in paths] == ["tab_x.csv", "tab_x.md", "tab_x.tex", "tab_x.provenance.json"]
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "tab_x.csv"), df)
    md = (tmp_path / "tab_x.md").read_text().splitlines()
    assert md[0] == "| method_name | acc | rank |" and md[2] == "| svd | 0.500 | 1 |" and len(md) == 4
    tex = (tmp_path / "tab_x.tex").read_text()
    assert r"\begin{tabular}{lrr}" in tex and r"method\_name & acc & rank \\" in tex
    assert r"gfwsvd & 0.123 & 2 \\" in tex and r"\caption{A \& B}" in tex and r"\label{tab:x}" in tex


def test_bad_names_are_rejected(tmp_path):
    with pytest.raises(FisherkronError):
        figures.save_figure(_fig(), "sub/x", tmp_path)
    with pytest.raises(FisherkronError):
        figures.save_table(pd.DataFrame(), "x", tmp_path)


def test_relative_output_dir_resolves_against_repo_root(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "fisherkron").mkdir()
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert figures.repo_root() == tmp_path
    assert figures.output_dir("figs") == tmp_path / "figs" and (tmp_path / "figs").is_dir()


def test_dirty_means_changed_sources_not_the_runs_own_outputs(tmp_path):
    """A notebook rewrites its committed figures one after another: those rewrites must not mark the
    provenance of its later outputs dirty, while an uncommitted source change must."""
    import subprocess

    from fisherkron.repro.figures import git_commit

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "figures").mkdir()
    (tmp_path / "notebooks" / "executed").mkdir(parents=True)
    for f in ("figures/t.csv", "notebooks/executed/n.ipynb", "code.py"):
        (tmp_path / f).write_text("0\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    assert git_commit(tmp_path)["dirty"] is False
    (tmp_path / "figures/t.csv").write_text("1\n")
    (tmp_path / "notebooks/executed/n.ipynb").write_text("1\n")
    assert git_commit(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("1\n")
    assert git_commit(tmp_path)["dirty"] is True


def test_a_start_that_is_not_a_perf_counter_reading_is_refused():
    import time

    from fisherkron.core.conventions import FisherkronError
    from fisherkron.repro.figures import provenance

    with pytest.raises(FisherkronError, match="perf_counter"):
        provenance("x", started=time.time())  # seconds since 1970: a negative wall time
    assert 0.0 <= provenance("x", started=time.perf_counter())["wall_seconds"] < 60


def test_machine_info_names_the_kernels_torch_runs(monkeypatch):
    import torch

    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert figures.machine_info()["kernels"] == f"ATen {torch.backends.cpu.get_cpu_capability()}"
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # a pinned MKL branch is part of what gives the bits
    assert figures.cpu_kernels().endswith(", MKL_CBWR=AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # and oneDNN's bound
    assert figures.cpu_kernels().endswith(", MKL_CBWR=AVX2, ONEDNN_MAX_CPU_ISA=AVX2")
