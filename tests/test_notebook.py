"""notebooks/quickstart.ipynb runs top to bottom (nbclient, the venv's python3 kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy  # a kernel and a short training: make test-ci (CI)
def test_quickstart_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    if Path(spec.argv[0]).resolve() != Path(sys.executable).resolve() and spec.argv[0] != "python":
        pytest.skip(f"kernel python3 runs {spec.argv[0]}, not this interpreter")
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    # The notebook writes runs/ and datasets/ in the nearest folder with a pyproject.toml above where it runs (the
    # repository's): here, this test's folder, not the checkout that holds it.
    (tmp_path / "pyproject.toml").write_text("")
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert (tmp_path / "runs" / "notebook" / "metrics.csv").is_file()
    assert (tmp_path / "datasets" / "synthetic-smoke").is_dir()
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "val/map_50" in out
    rows = (tmp_path / "runs" / "notebook" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 1  # the header and smoke's epoch: the validate after fit made no row
    predicted = next(c for c in nb.cells if "trainer.predict" in c.source)
    out = "".join(o.get("text", "") for o in predicted.outputs)
    assert "'val/map_50'" in out
    assert "detections in the first image" in out
    everything = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "LeafSpec" not in everything  # Lightning's own deprecation and product tip are left out (build)
    assert "Tip: For seamless" not in everything
