"""PNG plots from experiment data, and the stderr progress bar."""

import io

import pytest
from pagedkv.sim import costmodel, cpu_calibration, experiments, workloads
from pagedkv.sim.engine import SimConfig
from pagedkv.sim.progress import Progress

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_plot_writes_a_png(tmp_path):
    plots = pytest.importorskip("pagedkv.sim.plots")
    pytest.importorskip("matplotlib")
    workload = workloads.synthetic(80)
    config = SimConfig(num_slots=4096)
    compare = experiments.compare_allocators(workload, config)
    sweep = experiments.block_size_sweep(workload, config, block_sizes=(4, 16, 64))
    sharing = experiments.sharing_savings(widths=(2,), workload_names=("alpaca",), num_requests=3)
    cost_table = costmodel.CostModel().table((128, 1024), (1, 16))
    cpu = cpu_calibration.measure_cpu((32, 64), (1, 16)).to_dict()
    paths = {name: tmp_path / f"{name}.png" for name in ("shares", "sweep", "cost", "sharing", "demo")}
    plots.plot_shares(
        compare["results"],
        paths["shares"],
        title="t",
        published_token_states=experiments.PUBLISHED_FIGURE2_TOKEN_STATES,
    )
    plots.plot_sweep(sweep, paths["sweep"], title="t")
    plots.plot_costmodel(cost_table, cpu, paths["cost"])
    plots.plot_sharing(sharing["rows"], paths["sharing"], title="t")
    plots.plot_demo({"allocators": compare, "block_size_sweep": sweep}, paths["demo"])
    for path in paths.values():
        assert path.read_bytes()[:8] == PNG


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_only_after_the_delay_and_on_a_terminal(monkeypatch):
    monkeypatch.delenv("PAGEDKV_PROGRESS", raising=False)
    stream = _Tty()
    with Progress(4, "work", stream=stream, delay_s=0.0) as bar:
        for _ in range(4):
            bar.update(1, "step")
    text = stream.getvalue()
    assert "work [" in text and "4/4" in text and text.endswith("\n")

    quiet = _Tty()
    with Progress(4, "work", stream=quiet, delay_s=60.0) as bar:
        bar.update(4)
    assert quiet.getvalue() == ""

    captured = io.StringIO()  # not a terminal: silent unless forced
    with Progress(2, "work", stream=captured, delay_s=0.0) as bar:
        bar.update(2)
    assert captured.getvalue() == ""
    monkeypatch.setenv("PAGEDKV_PROGRESS", "1")
    with Progress(2, "work", stream=captured, delay_s=0.0) as bar:
        bar.update(2)
    assert "2/2" in captured.getvalue()
