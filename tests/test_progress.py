"""Progress on a terminal and in a log (issue 31, item 10: a bar redirected to a file wrote a line per update)."""

import io
import sys

from meshrl.progress import LineProgress, progress


def test_a_log_gets_a_line_every_tenth_not_every_step(monkeypatch, capsys):
    bar = progress(range(200), desc="GRPO", total=200)  # pytest's stderr is not a terminal
    assert isinstance(bar, LineProgress)
    for i in bar:
        bar.set_postfix(reward=f"{i / 200:.3f}")
        if i == 50:
            bar.write("[meshrl] held-out at step 50: ...")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11  # every 20 steps, and the one line written through the bar
    assert lines[0].startswith("[meshrl] GRPO: 20/200 steps, ") and lines[0].endswith("reward=0.095")
    assert lines[-1].startswith("[meshrl] GRPO: 200/200 steps") and "[meshrl] held-out at step 50: ..." in lines


def test_a_terminal_gets_the_bar(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress(range(3), desc="SFT", total=3, initial=0)
    assert type(bar).__name__ == "tqdm"
    assert list(bar) == [0, 1, 2]
