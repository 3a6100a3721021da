"""``torchmem run --live`` and the progress line: the installed command in a pseudo-terminal
(what a person sees, replayed on a small terminal model), without one (nothing but the
report), and the gauges they read, in this process, to the byte."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from standins import MiB
from torchmem.cli import main
from torchmem.cli.live import DeviceNow, Gauges, Reading, SiteNow, line, view
from torchmem.meters import meter
from torchmem.meters.base import background_thread
from torchmem.recording import record

pytestmark = pytest.mark.slow

counting = pytest.mark.counting
unix = pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
TITLE = "torchmem: where the memory went"
COLUMNS = 100

LIVE = textwrap.dedent(
    """\
    import time
    import torch

    x = torch.zeros(1024, 1024)
    y = torch.zeros(2048, 1024)
    del y
    print("allocated", flush=True)
    time.sleep(1)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    time.sleep(1)
    print("done")
    """
)
QUIET = "import time\nimport torch\n\nx = torch.zeros(1024, 1024)\ntime.sleep(SECONDS)\n"
READY = "import time\nimport torch\n\nx = torch.zeros(1024, 1024)\nprint('ready', flush=True)\n"


class Screen:
    """What a terminal shows once it has been sent `text`: the printable characters, carriage
    return, line feed, cursor up (``ESC [ n A``) and erase line (``ESC [ 2 K``); colours and
    the cursor's visibility show nothing. Any other control sequence fails the test: the
    model would not know what it does."""

    def __init__(self, text: str) -> None:
        self.rows: list[list[str]] = [[]]
        row = col = 0
        for found in re.finditer(r"\x1b\[([0-9;?]*)([A-Za-z])|\r|\n|[^\x1b\r\n]", text):
            token = found.group(0)
            if token == "\r":
                col = 0
            elif token == "\n":
                row += 1
            elif found.group(2) == "A":
                row = max(row - int(found.group(1) or 1), 0)
            elif found.group(2) == "K":
                assert found.group(1) == "2", token
                self.rows[row] = []
            elif found.group(2) in ("m", "h", "l"):
                continue
            elif token.startswith("\x1b"):
                raise AssertionError(f"unexpected control sequence {token!r}")
            else:
                while len(self.rows) <= row:
                    self.rows.append([])
                cells = self.rows[row]
                cells.extend(" " * (col - len(cells)))
                cells[col : col + 1] = [token]
                col += 1
            while len(self.rows) <= row:
                self.rows.append([])

    @property
    def lines(self) -> list[str]:
        return ["".join(cells).rstrip() for cells in self.rows]


def in_terminal(
    *words: str, cwd: Path, interrupt_after: str | None = None
) -> tuple[int | None, str]:
    """``torchmem run WORDS`` with a pseudo-terminal as stdin, stdout and stderr: its exit
    code (negative: the signal that ended it) and what it wrote there. With
    `interrupt_after`, Ctrl-C (SIGINT) is sent once that text and a second have passed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    hidden = ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    env["TERM"] = "xterm-256color"
    command = [sys.executable, "-m", "torchmem", "run", *words]
    with subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env) as p:
        os.close(slave)
        output, seen, deadline = b"", None, time.monotonic() + 120
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every copy of the terminal's other end is closed
                    break
                if not data:
                    break
                output += data
            if interrupt_after and seen is None and interrupt_after.encode() in output:
                seen = time.monotonic()
            if seen is not None and time.monotonic() > seen + 1:
                p.send_signal(signal.SIGINT)
                seen = float("inf")
        os.close(master)
        return p.wait(timeout=60), output.decode()


def plain(text: str) -> list[str]:
    """`text`'s lines as written, colours and cursor moves left out."""
    return re.split(r"\r\n|\r|\n", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text))


def live_view(screen: list[str]) -> list[str]:
    """The lines of `screen` before the report that belong to the ``--live`` view."""
    before = screen[: next((i for i, s in enumerate(screen) if s.startswith(TITLE)), None)]
    return [s for s in before if s.startswith(("torchmem run ", "device ", "cpu ", "ram "))]


def untimed(lines: list[str]) -> list[str]:
    """`lines` without what changes from run to run: seconds, the ram row."""
    return [re.sub(r"\d+\.\d+s\b", "#s", s) for s in lines if not s.startswith("ram ")]


@counting
@unix
def test_the_live_view_shows_exact_bytes_now_and_at_the_peak_and_the_steps(
    tmp_path: Path,
) -> None:
    (tmp_path / "script.py").write_text(LIVE)
    code, written = in_terminal("--live", "script.py", cwd=tmp_path)
    assert code == 0, written
    shown = plain(written)
    cpu = [tuple(s.split()[1:]) for s in shown if re.fullmatch(r"cpu +\S+ +\S+", s.strip())]
    assert ("4.00M", "12.00M") in cpu, shown
    assert cpu[-1] == ("4.00M", "12.00M")  # x, and x beside y (plus 160 bytes of Linear)
    steps = [int(n) for n in re.findall(r"torchmem run +\d+\.\ds +step (\d+)", "\n".join(shown))]
    assert steps == sorted(steps) and steps[-1] == 3, steps
    screen = Screen(written).lines
    assert not live_view(screen), screen
    said = [s for s in screen if s in ("allocated", "done") or s.startswith(TITLE)]
    assert said[:3] == ["allocated", "done", said[2]] and said[2].startswith(TITLE), screen


@counting
@unix
def test_a_refresh_never_lands_inside_a_line_the_script_prints(tmp_path: Path) -> None:
    """Lines printed as fast as the script can, for longer than many refreshes: each comes
    once, in order, above the view, and the view is gone at the end. (``rich``'s own
    proxies wrote a line after releasing the view's lock: a refresh in between left
    copies of the view on the screen and lines glued to them.)"""
    script = textwrap.dedent(
        """\
        import sys, time
        import torch

        sys.setswitchinterval(1e-6)  # threads take turns as often as they can
        makers = [
            lambda: torch.zeros(64),
            lambda: torch.zeros(64),
            lambda: torch.zeros(64),
        ]
        held = []
        end = time.monotonic() + 2
        i = 0
        while time.monotonic() < end or i < 600:  # a loaded machine prints fewer a second
            print(f"line {i}")
            if i % 4 == 3:  # the view's list of sites grows and shrinks
                held.clear()
            held.append(makers[i % 3]())
            for _ in range(50):  # rows for the log's drain thread to tally
                torch.ones(1)
            i += 1
        """
    )
    (tmp_path / "script.py").write_text(script)
    code, written = in_terminal("--live", "--device", "cpu", "script.py", cwd=tmp_path)
    assert code == 0, written
    screen = Screen(written).lines
    printed = screen[: next(i for i, s in enumerate(screen) if s.startswith(TITLE))]
    printed = [s for s in printed if s]
    assert printed == [f"line {i}" for i in range(len(printed))], printed[-20:]
    assert len(printed) > 500


@counting
@unix
def test_the_progress_line_shows_after_three_seconds_and_is_gone_before_the_report(
    tmp_path: Path,
) -> None:
    (tmp_path / "script.py").write_text(QUIET.replace("SECONDS", "4.5"))
    code, written = in_terminal("--device", "cpu", "script.py", cwd=tmp_path)
    assert code == 0, written
    drawn = re.findall(r"\rtorchmem: (\d+\.\d)s  cpu 4\.00M \(peak 4\.00M\)  step 0", written)
    assert drawn and 3.0 <= float(drawn[0]) < 4.5, written
    assert "\x1b" not in written.partition(TITLE)[0]  # a carriage return, no control code
    quiet_code, quiet = in_terminal("--no-progress", "--device", "cpu", "script.py", cwd=tmp_path)
    assert quiet_code == 0 and "\rtorchmem: " not in quiet, quiet
    assert untimed(Screen(written).lines) == untimed(Screen(quiet).lines)


@counting
def test_without_a_terminal_there_is_nothing_but_the_report(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(QUIET.replace("SECONDS", "3.5") + "print('hi')\n")

    def run(*words: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "torchmem", "run", "--device", "cpu", *words]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)

    default, quiet, live = (
        run("script.py"),
        run("--no-progress", "script.py"),
        run("--live", "script.py"),
    )
    assert default.stdout == quiet.stdout == "hi\n"
    assert "\r" not in default.stderr and default.stderr.startswith(f"\n{TITLE} ("), default.stderr
    assert untimed(default.stderr.splitlines()) == untimed(quiet.stderr.splitlines())
    note = "torchmem run: --live shows nothing here: stderr is not a terminal\n"
    assert live.stderr.startswith(note), live.stderr


@counting
@unix
@pytest.mark.parametrize(
    ("end", "code", "said"),
    [
        ("time.sleep(60)", -signal.SIGINT, "KeyboardInterrupt"),  # Ctrl-C a second after
        ("time.sleep(1.5)\nraise ValueError('boom')", 1, "ValueError: boom"),
    ],
    ids=["ctrl-c", "error"],
)
def test_the_live_view_is_removed_as_a_run_ends_badly_and_the_end_is_as_without_it(
    tmp_path: Path, end: str, code: int, said: str
) -> None:
    (tmp_path / "script.py").write_text(READY + end + "\n")
    words = ("--device", "cpu", "script.py")
    interrupt = "ready" if code < 0 else None
    live_code, live = in_terminal("--live", *words, cwd=tmp_path, interrupt_after=interrupt)
    plain_code, without = in_terminal(*words, cwd=tmp_path, interrupt_after=interrupt)
    assert live_code == plain_code == code, live
    assert re.search(r"cpu +4\.00M +4\.00M", "\n".join(plain(live)))  # it was shown
    screen = Screen(live).lines
    assert not live_view(screen), screen
    assert said in "\n".join(screen).partition(TITLE)[0]
    assert untimed(screen) == untimed(Screen(without).lines)


def test_live_without_rich_says_what_to_install_before_the_script_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "script.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.setitem(sys.modules, "rich", None)  # as if it were not installed
    assert main(["run", "--live", str(script)]) == 2
    err = capsys.readouterr().err
    assert err == (
        'torchmem run: error: torchmem run --live needs rich: pip install "torchmem[live]"\n'
    )
    assert not (tmp_path / "ran").exists()


READING = Reading(
    elapsed=12.34,
    steps=45,
    devices=(
        DeviceNow("cuda:0", 1288490189, 3650722202),
        DeviceNow("cuda:1", 0, 0),  # a GPU the run has not used
        DeviceNow("cpu", 39017513, 40 * MiB),
        DeviceNow("ram", 500 * MiB, 600 * MiB),
    ),
    sites=(SiteNow("train.py:37  main", 4 * MiB), SiteNow("<before recording>", 512)),
    sites_at=11.5,
)


def test_the_progress_line_names_each_tensor_device_used_and_the_steps() -> None:
    assert line(READING) == (
        "torchmem: 12.3s  cuda:0 1.20G (peak 3.40G)  cpu 37.21M (peak 40.00M)  step 45"
    )
    ram_only = READING._replace(devices=READING.devices[3:], steps=0)
    assert line(ram_only) == "torchmem: 12.3s  ram 500.00M (peak 600.00M)  step 0"


def test_the_live_view_lists_devices_and_the_sites_alive() -> None:
    out = io.StringIO()
    Console(file=out, width=60, color_system=None).print(view(READING))
    assert [s.rstrip() for s in out.getvalue().splitlines()] == [
        "torchmem run  12.3s  step 45",
        "device      now     peak",
        "cuda:0    1.20G    3.40G",
        "cpu      37.21M   40.00M",
        "ram     500.00M  600.00M",
        "",
        "CPU allocations alive at 11.5s, by site",
        "  bytes  site",
        "  4.00M  train.py:37  main",
        "512.00B  <before recording>",
    ]


def read(gauges: Gauges) -> Reading:
    """What `gauges` read from a thread of torchmem's own, as the views read them."""
    found: list[Reading] = []
    thread = background_thread(lambda: found.append(gauges.read()), "torchmem-test")
    thread.start()
    thread.join()
    return found[0]


@counting
def test_the_gauges_read_exact_bytes_steps_and_sites_from_a_thread_of_torchmems() -> None:
    model = torch.nn.Linear(4, 4)  # 80 bytes of parameters, 80 of gradients once stepped
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recording = record("cpu").start()
    gauges = Gauges(recording)
    gauges.open()
    try:
        before = meter("cpu").used()
        x = torch.zeros(1024, 1024)
        y = torch.zeros(2048, 1024)
        del y
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        running = read(gauges)
        recording.stop()
        tallied = read(gauges)
    finally:
        gauges.close()
        recording.stop()
    optimizer.step()  # the hook is gone: not counted
    assert running.devices == (DeviceNow("cpu", before + 4 * MiB + 80, before + 12 * MiB),)
    assert running.steps == 2 and read(gauges).steps == 2
    here = Path(__file__).name
    assert tallied.sites[0].bytes == 4 * MiB
    assert re.fullmatch(rf".*{here}:\d+  test_the_gauges_read_.*", tallied.sites[0].site)
    assert tallied.sites_at is not None and 0 <= tallied.sites_at <= tallied.elapsed
    del x


@pytest.mark.cuda
def test_the_gauges_read_a_gpus_exact_bytes_from_a_thread_of_torchmems() -> None:
    recording = record("cuda:0").start()
    gauges = Gauges(recording)
    gauges.open()
    try:
        before = torch.cuda.memory_allocated(0)
        x = torch.zeros(256, 1024, device="cuda")  # 1 MiB, a multiple of the allocator's blocks
        y = torch.zeros(512, 1024, device="cuda")
        del y
        reading = read(gauges)
    finally:
        gauges.close()
        recording.stop()
    assert reading.devices == (DeviceNow("cuda:0", before + MiB, before + 3 * MiB),)
    assert (reading.sites, reading.sites_at) == ((), None)  # no CPU log in this recording
    del x
