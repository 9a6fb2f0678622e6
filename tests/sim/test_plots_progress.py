"""PNG plots from experiment data, and the stderr progress bar."""

import io

import pytest
from pagedkv.sim import costmodel, cpu_calibration, experiments, workloads
from pagedkv.sim.engine import SimConfig
from pagedkv.sim.progress import Progress

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def drawn_figures(monkeypatch):
    """Every figure a plot function saves, kept open for inspection (then saved as usual)."""
    plots = pytest.importorskip("pagedkv.sim.plots")
    pytest.importorskip("matplotlib")
    figures = []
    save = plots._save

    def keep(figure, path):
        figure.tight_layout()
        figure.canvas.draw()  # lay out, so that legend and axes positions are final
        figure.pagedkv_test_renderer = figure.canvas.get_renderer()  # closing the figure drops it
        figures.append(figure)
        save(figure, path)

    monkeypatch.setattr(plots, "_save", keep)
    return plots, figures


def _check_readable(figure):
    """Every panel has labelled axes, tick labels of a readable size, and a legend off its data."""
    renderer = figure.pagedkv_test_renderer
    for axis in figure.axes:
        assert axis.get_ylabel(), f"panel {axis.get_title()!r} has no y label"
        if axis.get_xaxis().get_visible() and axis.get_xticklabels():
            assert axis.get_xlabel(), f"panel {axis.get_title()!r} has no x label"
        for label in axis.get_xticklabels() + axis.get_yticklabels():
            assert label.get_fontsize() >= 8, (axis.get_title(), label.get_text())
        legend = axis.get_legend()
        if legend is not None:
            box = legend.get_window_extent(renderer)
            data = axis.get_window_extent(renderer)
            assert not box.overlaps(data), f"the legend of {axis.get_title()!r} covers its data"


def test_every_plot_writes_a_readable_png(tmp_path, drawn_figures):
    plots, figures = drawn_figures
    workload = workloads.synthetic(80)
    config = SimConfig(num_slots=4096)
    compare = experiments.compare_allocators(workload, config)
    sweep = experiments.block_size_sweep(workload, config, block_sizes=(1, 4, 16, 64))
    sharing = experiments.sharing_savings(widths=(2,), workload_names=("alpaca",), num_requests=3)
    recovery = experiments.recovery(workload, SimConfig(num_slots=2048))
    cost_table = costmodel.CostModel().table((128, 1024), (1, 16))
    cpu = cpu_calibration.measure_cpu((32, 64), (1, 16)).to_dict()
    paths = {name: tmp_path / f"{name}.png" for name in ("shares", "sweep", "cost", "sharing", "recovery")}
    plots.plot_shares(
        compare["results"],
        paths["shares"],
        title="t",
        published_token_states=experiments.PUBLISHED_FIGURE2_TOKEN_STATES,
    )
    plots.plot_sweep(sweep, paths["sweep"], title="t")
    plots.plot_costmodel(cost_table, cpu, paths["cost"])
    plots.plot_sharing(sharing, paths["sharing"], title="t")
    plots.plot_recovery(recovery, paths["recovery"], title="t")
    for path in paths.values():
        assert path.read_bytes()[:8] == PNG
    assert len(figures) == len(paths)
    for figure in figures:
        _check_readable(figure)
    # Block size 1 wastes nothing per request: the point stays on the (symlog) axis.
    sweep_axis = figures[1].axes[0]
    assert sweep_axis.get_yscale() == "symlog"
    waste_line = sweep_axis.get_lines()[0]
    assert waste_line.get_xdata()[0] == 1 and waste_line.get_ydata()[0] == 0


def test_the_demo_plot_covers_all_six_sections(tmp_path, drawn_figures):
    plots, figures = drawn_figures
    demo = experiments.demo(out=lambda text: None, progress=False, num_requests=60)
    plots.plot_demo(demo, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == PNG
    (figure,) = figures
    titles = [axis.get_title() for axis in figure.axes if axis.get_title()]
    assert [title[:3] for title in titles] == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)"]
    assert len(experiments.DEMO_SECTIONS) == 6
    _check_readable(figure)


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
