"""The visualizer in a real browser: headless Chromium loads the page from file://, the test
clicks step / play / reset, switches block size, allocator and seed by mouse and keyboard, and
checks the DOM counters and the decoded pool against the simulator's own frames."""

from __future__ import annotations

import time

import pytest
from pagedkv.viz.page import write_page
from pagedkv.viz.record import VizGrid, record_grid
from viz_browser import screenshot, set_viewport, start_chromium

ALLOCATORS = ("paged", "contiguous-max")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
SEEDS = (0, 1)
NUM_SLOTS = 1024
MAX_MODEL_LEN = 256
MAX_STEPS = 120
FREE_RGB = [0xDF, 0xE3, 0xEA]  # viz.js FREE_COLOR


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(page path, {(allocator, block_size, seed): raw recording}) from the real simulator."""
    from pagedkv.sim.engine import SimConfig, record_frames
    from pagedkv.sim.workloads import make_workload

    raw = {}

    def capture(workload, config, *, max_steps):
        recording = record_frames(workload, config, max_steps=max_steps)
        raw[(config.allocator, config.block_size, config.seed)] = recording
        return recording

    data = record_grid(
        lambda seed: make_workload("synthetic", num_requests=60, seed=seed, max_model_len=MAX_MODEL_LEN),
        SimConfig(num_slots=NUM_SLOTS, max_model_len=MAX_MODEL_LEN),
        VizGrid(allocators=ALLOCATORS, block_sizes=BLOCK_SIZES, seeds=SEEDS, max_steps=MAX_STEPS),
        recorder=capture,
    )
    path = write_page(data, tmp_path_factory.mktemp("viz") / "viz.html")
    return path, raw


@pytest.fixture(scope="module")
def browser():
    driver = start_chromium(1280, 800)
    yield driver
    driver.quit()


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def counters(driver) -> dict[str, str]:
    return js(
        driver,
        """
        const out = {};
        for (const id of ["step", "running", "waiting", "finished", "blocks", "waste", "preemptions"])
            out[id] = document.getElementById("c-" + id).textContent;
        return out;""",
    )


def expected_counters(recording, frame_index) -> dict[str, str]:
    frame = recording["frames"][frame_index]
    return {
        "step": str(frame["step"]),
        "running": str(frame["running"]),
        "waiting": str(frame["waiting"]),
        "finished": str(frame["finished"]),
        "blocks": f"{frame['used_blocks']} / {recording['num_blocks']}",
        "preemptions": str(frame["preemptions"]),
        "waste": frame["waste_pct"],
    }


def assert_matches(driver, raw, allocator, block_size, seed, frame_index):
    state = js(driver, "return window.pagedkvViz.state()")
    assert (state["allocator"], state["blockSize"], state["seed"], state["frame"]) == (
        allocator,
        block_size,
        seed,
        frame_index,
    )
    recording = raw[(allocator, block_size, seed)]
    want = expected_counters(recording, frame_index)
    got = counters(driver)
    waste_text = got.pop("waste")
    waste = want.pop("waste")
    assert got == want, f"{allocator} bs={block_size} seed={seed} frame {frame_index}"
    assert waste_text.endswith(" %")
    assert float(waste_text[:-2]) == pytest.approx(waste, abs=0.051)
    # The fragmentation figure shows the simulator's slot accounting.
    frame = recording["frames"][frame_index]
    figure = js(
        driver,
        """return ["token", "reserved", "frag", "ext", "free"].map(
        (k) => document.getElementById("f-" + k).textContent)""",
    )
    want_slots = [
        frame["token_slots"],
        frame["reserved_slots"],
        frame["internal_frag_slots"],
        frame["external_frag_slots"],
        frame["free_slots"],
    ]
    assert [int(text.split(" slots")[0]) for text in figure] == want_slots
    assert sum(want_slots) == NUM_SLOTS
    # The page's decoded pool and block tables equal the simulator's frame, cell for cell.
    decoded = js(driver, "return window.pagedkvViz.frameData()")
    frame = recording["frames"][frame_index]
    flat = [int(v) for cell in frame["pool"] for v in cell]
    assert decoded["pool"] == flat
    tables = sorted(
        [int(rid), 0, int(t["num_tokens"]), [int(b) for b in t["blocks"]]]
        for rid, t in frame["tables"].items()
    )
    assert decoded["tables"] == tables
    assert js(driver, "return document.querySelectorAll('#tables-list li[data-rid]').length") == len(tables)
    # The canvas paints free cells grey and token-holding cells in their request's colour.
    for cell, (owner, tokens, _) in list(enumerate(frame["pool"]))[:: max(1, len(frame["pool"]) // 40)]:
        if owner == state.get("selectedRid"):
            continue
        color = js(driver, "return window.pagedkvViz.cellColor(arguments[0])", cell)
        if owner < 0:
            assert color[:3] == FREE_RGB, f"cell {cell} is free but painted {color}"
        elif tokens > 0:
            assert color[:3] != FREE_RGB, f"cell {cell} holds tokens of {owner} but is painted free"


def select(driver, element_id, value):
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(str(value))


def press(driver, key):
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(key).perform()


def wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_page_follows_the_simulator(browser, recorded):
    from selenium.webdriver.common.keys import Keys

    path, raw = recorded
    driver = browser
    driver.get(path.as_uri())
    wait_for(lambda: js(driver, "return document.body.dataset.ready") == "true", what="page ready")
    assert_matches(driver, raw, "paged", 16, 0, 0)

    for _ in range(3):
        driver.find_element("id", "btn-step").click()
    assert_matches(driver, raw, "paged", 16, 0, 3)

    select(driver, "sel-block-size", 4)
    assert_matches(driver, raw, "paged", 4, 0, 3)
    driver.find_element("id", "btn-back").click()
    assert_matches(driver, raw, "paged", 4, 0, 2)

    # Play a while, pause, and check wherever it stopped.
    driver.find_element("id", "btn-play").click()
    wait_for(lambda: js(driver, "return window.pagedkvViz.state().frame") >= 12, what="playback")
    driver.find_element("id", "btn-play").click()
    frame = js(driver, "return window.pagedkvViz.state().frame")
    assert not js(driver, "return window.pagedkvViz.state().playing")
    assert int(driver.find_element("id", "rng-step").get_attribute("value")) == frame
    assert_matches(driver, raw, "paged", 4, 0, frame)

    # Keyboard only: focus leaves the controls, then shortcuts drive everything.
    js(driver, "document.activeElement.blur()")
    press(driver, Keys.ARROW_RIGHT)
    assert_matches(driver, raw, "paged", 4, 0, frame + 1)
    press(driver, "b")
    assert_matches(driver, raw, "paged", 8, 0, frame + 1)
    press(driver, "a")
    assert_matches(driver, raw, "contiguous-max", 8, 0, frame + 1)
    press(driver, "s")
    assert_matches(driver, raw, "contiguous-max", 8, 1, frame + 1)
    press(driver, Keys.END)
    last = len(raw[("contiguous-max", 8, 1)]["frames"]) - 1
    assert_matches(driver, raw, "contiguous-max", 8, 1, last)

    # Every block size of the grid, through the select, at a mid-run step.
    select(driver, "sel-allocator", "paged")
    js(
        driver,
        "const r = document.getElementById('rng-step'); r.value = 40;r.dispatchEvent(new Event('input'))",
    )
    for block_size in BLOCK_SIZES:
        select(driver, "sel-block-size", block_size)
        assert_matches(
            driver, raw, "paged", block_size, 1, min(40, len(raw[("paged", block_size, 1)]["frames"]) - 1)
        )

    driver.find_element("id", "btn-reset").click()
    assert_matches(driver, raw, "paged", 32, 1, 0)

    errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == []


def test_keyboard_reaches_every_control(browser, recorded):
    from selenium.webdriver.common.keys import Keys

    path, _ = recorded
    driver = browser
    driver.get(path.as_uri())
    wait_for(lambda: js(driver, "return document.body.dataset.ready") == "true", what="page ready")
    js(driver, "document.activeElement.blur()")
    reached = []
    for _ in range(14):
        press(driver, Keys.TAB)
        reached.append(js(driver, "return document.activeElement.id"))
    for control in (
        "sel-allocator",
        "sel-block-size",
        "sel-seed",
        "btn-reset",
        "btn-back",
        "btn-play",
        "btn-step",
        "sel-speed",
        "rng-step",
    ):
        assert control in reached
    # Space on the focused play button toggles playback (the button's own activation).
    driver.find_element("id", "btn-play").send_keys(Keys.SPACE)
    assert js(driver, "return window.pagedkvViz.state().playing")
    press(driver, "k")
    assert not js(driver, "return window.pagedkvViz.state().playing")


@pytest.mark.parametrize(
    "width,height,name", [(1280, 800, "viz-1280x800.png"), (390, 844, "viz-390x844.png")]
)
def test_layout_and_screenshot(browser, recorded, width, height, name):
    path, _ = recorded
    driver = browser
    set_viewport(driver, width, height)
    try:
        driver.get(path.as_uri())
        wait_for(lambda: js(driver, "return document.body.dataset.ready") == "true", what="page ready")
        for _ in range(30):
            driver.find_element("id", "btn-step").click()
        # Nothing overflows sideways, the pool canvas fits its panel, the counters are visible.
        assert js(driver, "return document.documentElement.scrollWidth") <= width
        canvas = js(
            driver,
            "const r = document.getElementById('pool-canvas').getBoundingClientRect();"
            "return [r.left, r.right, r.height]",
        )
        assert canvas[0] >= 0 and canvas[1] <= width and canvas[2] > 50
        running = driver.find_element("id", "c-running")
        assert running.is_displayed() and running.text.strip() != ""
        shot = screenshot(driver, name)
        assert shot.stat().st_size > 10_000
    finally:
        set_viewport(driver, 1280, 800)


@pytest.mark.parametrize(
    "allocator,block_size,seed", [("paged", 16, 0), ("paged", 1, 1), ("contiguous-max", 32, 1)]
)
def test_every_step_through_the_slider(browser, recorded, allocator, block_size, seed):
    """Drag the slider over every step of a run: the counters shown match the simulator."""
    path, raw = recorded
    driver = browser
    driver.get(path.as_uri())
    wait_for(lambda: js(driver, "return document.body.dataset.ready") == "true", what="page ready")
    select(driver, "sel-allocator", allocator)
    select(driver, "sel-seed", seed)
    select(driver, "sel-block-size", block_size)
    shown = js(
        driver,
        """
        const range = document.getElementById("rng-step");
        const rows = [];
        for (let f = 0; f <= Number(range.max); f++) {
            range.value = f;
            range.dispatchEvent(new Event("input"));
            rows.push(["step", "running", "waiting", "finished", "blocks", "waste", "preemptions"]
                .map((id) => document.getElementById("c-" + id).textContent));
        }
        return rows;""",
    )
    recording = raw[(allocator, block_size, seed)]
    assert len(shown) == len(recording["frames"])
    for index, row in enumerate(shown):
        want = expected_counters(recording, index)
        waste = want.pop("waste")
        got = dict(
            zip(
                ["step", "running", "waiting", "finished", "blocks", "waste", "preemptions"], row, strict=True
            )
        )
        assert float(got.pop("waste")[:-2]) == pytest.approx(waste, abs=0.051), f"frame {index}"
        assert got == want, f"frame {index}"


# ---- parallel sampling: one block table per sequence, shared blocks marked ------------------

GROUP_SIZE = 4
GROUP_BLOCK_SIZES = (4, 16)


@pytest.fixture(scope="module")
def recorded_groups(tmp_path_factory):
    """(page path, {(allocator, block_size, seed): raw recording}) of a parallel-sampling workload."""
    from pagedkv.sim.engine import SimConfig, record_frames
    from pagedkv.sim.workloads import make_workload, with_groups

    raw = {}

    def capture(workload, config, *, max_steps):
        raw[(config.allocator, config.block_size, config.seed)] = recording = record_frames(
            workload, config, max_steps=max_steps
        )
        return recording

    data = record_grid(
        lambda seed: with_groups(
            make_workload("synthetic", num_requests=30, seed=seed, max_model_len=MAX_MODEL_LEN),
            GROUP_SIZE,
            "parallel",
        ),
        SimConfig(num_slots=NUM_SLOTS, max_model_len=MAX_MODEL_LEN),
        VizGrid(allocators=("paged",), block_sizes=GROUP_BLOCK_SIZES, seeds=(0,), max_steps=MAX_STEPS),
        recorder=capture,
    )
    return write_page(data, tmp_path_factory.mktemp("viz-groups") / "viz.html"), raw


def chip_blocks(text: str) -> tuple[list[int], list[int]]:
    """'2–4→17–19' -> ([2, 3, 4], [17, 18, 19]); '5→9' -> ([5], [9]): logical and physical ids."""
    logical, physical = text.split("→")
    lo = [int(v) for v in logical.split("–")]
    ph = [int(v) for v in physical.split("–")]
    return list(range(lo[0], lo[-1] + 1)), list(range(ph[0], ph[-1] + 1))


def shown_tables(driver) -> list[dict]:
    """What the tables panel shows: per row its request, sample, token text and chips."""
    return js(
        driver,
        """
        return Array.from(document.querySelectorAll("#tables-list li[data-rid]")).map((li) => ({
            rid: Number(li.dataset.rid), sample: Number(li.dataset.sample),
            label: li.querySelector("button.rid").textContent,
            ntok: li.querySelector(".ntok").textContent,
            chips: Array.from(li.querySelectorAll(".chip:not(.more)")).map((c) => ({
                text: c.firstChild.textContent, shared: c.classList.contains("shared"),
                refs: c.querySelector(".refs") ? c.querySelector(".refs").textContent : ""})),
            more: li.querySelector(".chip.more") !== null,
        }));""",
    )


def assert_group_tables(driver, recording, frame_index) -> tuple[int, int]:
    """The panel lists every sequence of the frame with its blocks and tokens; shared blocks
    carry their refcount. Returns (sequences in groups, shared chips) seen."""
    frame = recording["frames"][frame_index]
    refcount = {int(b): int(r) for b, r in frame["shared"]}
    want = sorted(
        (
            int(rid),
            sample,
            int(seq["num_tokens"]),
            [int(b) for b in seq["blocks"]],
            len(entry.get("sequences", [1])),
        )
        for rid, entry in frame["tables"].items()
        for sample, seq in enumerate(entry.get("sequences") or [entry])
    )
    rows = shown_tables(driver)
    assert [(r["rid"], r["sample"]) for r in rows] == [(w[0], w[1]) for w in want], f"frame {frame_index}"
    in_groups = shared_chips = 0
    for row, (rid, sample, num_tokens, blocks, group_len) in zip(rows, want, strict=True):
        where = f"frame {frame_index} request {rid} sample {sample}"
        assert row["ntok"].startswith(f"{num_tokens} tokens · {len(blocks)} block"), where
        if group_len > 1:
            in_groups += 1
            assert row["label"] == f"req {rid} · sample {sample}", where
        else:
            assert row["label"] == f"req {rid}", where
        logical, physical = [], []
        for chip in row["chips"]:
            lo, ph = chip_blocks(chip["text"])
            assert len(lo) == len(ph), where
            logical += lo
            physical += ph
            refs = {refcount.get(b, 1) for b in ph}
            assert len(refs) == 1, f"{where}: chip {chip} mixes refcounts {refs}"
            (count,) = refs
            assert chip["shared"] == (count > 1), f"{where}: chip {chip}, refcount {count}"
            if count > 1:
                shared_chips += 1
                assert chip["refs"].strip() == f"×{count}", where
        assert logical == list(range(len(logical))), where
        if row["more"]:
            assert physical == blocks[: len(physical)], where
        else:
            assert physical == blocks, where
    return in_groups, shared_chips


def test_group_tables_show_every_sequence(browser, recorded_groups):
    path, raw = recorded_groups
    driver = browser
    driver.get(path.as_uri())
    wait_for(lambda: js(driver, "return document.body.dataset.ready") == "true", what="page ready")
    seen_groups = seen_shared = 0
    for block_size in GROUP_BLOCK_SIZES:
        select(driver, "sel-block-size", block_size)
        recording = raw[("paged", block_size, 0)]
        last = len(recording["frames"]) - 1
        for frame_index in sorted({0, 1, 5, 20, last // 2, last}):
            js(
                driver,
                "const r = document.getElementById('rng-step'); r.value = arguments[0];"
                "r.dispatchEvent(new Event('input'))",
                frame_index,
            )
            assert js(driver, "return window.pagedkvViz.state().frame") == frame_index
            groups, shared = assert_group_tables(driver, recording, frame_index)
            seen_groups += groups
            seen_shared += shared
            decoded = js(driver, "return window.pagedkvViz.frameData()")
            assert decoded["shared"] == sorted(
                [int(b), int(r)] for b, r in recording["frames"][frame_index]["shared"]
            )
            count = driver.find_element("id", "tables-count").text
            assert count.startswith(f"({len(recording['frames'][frame_index]['tables'])} running")
    assert seen_groups > 0, "no frame showed a request with several sequences"
    assert seen_shared > 0, "no frame showed a shared block"
    # Stepping with the button keeps the tables in step with the simulator too.
    select(driver, "sel-block-size", 4)
    js(
        driver,
        "const r = document.getElementById('rng-step'); r.value = 3; r.dispatchEvent(new Event('input'))",
    )
    driver.find_element("id", "btn-step").click()
    assert_group_tables(driver, raw[("paged", 4, 0)], 4)
    # Tapping a shared block in the pool names its refcount.
    block, refs = (int(v) for v in raw[("paged", 4, 0)]["frames"][4]["shared"][0])
    info = js(
        driver,
        """
        const canvas = document.getElementById("pool-canvas"), rect = canvas.getBoundingClientRect();
        const slot = arguments[0] * 4, slotW = rect.width / 64;
        const rowH = rect.height / Math.ceil(arguments[1] / 64);
        canvas.dispatchEvent(new MouseEvent("click", {bubbles: true,
            clientX: rect.left + (slot % 64 + 0.5) * slotW,
            clientY: rect.top + (Math.floor(slot / 64) + 0.5) * rowH}));
        return document.getElementById("cell-info").textContent;""",
        block,
        NUM_SLOTS,
    )
    assert info.startswith(f"Block {block}: request ") and info.endswith(
        f"shared by {refs} sequences (copy-on-write)"
    )
    errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == []


@pytest.mark.parametrize(
    "width,height,name", [(1280, 800, "viz-groups-1280x800.png"), (390, 844, "viz-groups-390x844.png")]
)
def test_group_layout_and_screenshot(browser, recorded_groups, width, height, name):
    path, _ = recorded_groups
    driver = browser
    set_viewport(driver, width, height)
    try:
        driver.get(path.as_uri())
        wait_for(lambda: js(driver, "return document.body.dataset.ready") == "true", what="page ready")
        select(driver, "sel-block-size", 4)
        for _ in range(12):
            driver.find_element("id", "btn-step").click()
        assert js(driver, "return document.documentElement.scrollWidth") <= width
        # No table row sticks out of the panel sideways.
        overflow = js(
            driver,
            """
            const panel = document.getElementById("tables-list").getBoundingClientRect();
            return Array.from(document.querySelectorAll("#tables-list li")).filter(
                (li) => li.getBoundingClientRect().right > panel.right + 1).length;""",
        )
        assert overflow == 0
        # Scroll the tables' heading just below the (sticky on wide screens) control bar.
        js(
            driver,
            """const bar = document.getElementById("controls");
            const below = bar && getComputedStyle(bar).position === "sticky"
                ? bar.getBoundingClientRect().height : 0;
            const title = document.getElementById("tables-title");
            window.scrollTo(0, title.getBoundingClientRect().top + window.scrollY - below - 8);""",
        )
        shot = screenshot(driver, name)
        assert shot.stat().st_size > 10_000
    finally:
        set_viewport(driver, 1280, 800)
